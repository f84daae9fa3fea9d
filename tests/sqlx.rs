//! The sqlx driver (`SqlxStore`) over the app's own `sqlx::PgPool`: the layer suite in
//! lease mode, and what this driver shares with the tokio-postgres one (the table, its
//! rows, the classification of errors); a table in generations rotated under sqlx.
#![cfg(feature = "sqlx")]

mod common;

use sqlx::{PgPool, postgres::PgPoolOptions};
use tower_idempotency::store::SqlxStore;

use common::{TestSchema, database_url, pooler_url};

/// A pool of `size` connections to `url`.
async fn pool(url: &str, size: u32) -> PgPool {
    PgPoolOptions::new()
        .max_connections(size)
        .connect(url)
        .await
        .expect("pool")
}

/// A migrated store on a pool of its own in `schema`. With `TI_POOLER_URL` set, its
/// statements go through the transaction pooler, unnamed, and it listens on the
/// database directly, as a deployment behind PgBouncer would.
async fn store(schema: &TestSchema) -> SqlxStore {
    let store = match pooler_url() {
        Some(pooler) => SqlxStore::new(pool(&pooler, 8).await)
            .with_transaction_pooling(true)
            .with_notification_pool(pool(&database_url(), 1).await),
        None => SqlxStore::new(pool(&database_url(), 8).await),
    };
    let store = store.with_schema_name(&schema.name).expect("schema name");
    store.migrate().await.expect("migrate");
    store
}

mod lease {
    use std::sync::Arc;

    use tower_idempotency::store::Store;

    use crate::common::TestSchema;

    async fn make() -> (Arc<dyn Store>, TestSchema) {
        let schema = TestSchema::new();
        (Arc::new(super::store(&schema).await), schema)
    }

    crate::layer_suite!(make);
}

/// A request through a layer over each driver.
mod drivers {
    use std::{sync::Arc, time::Duration};

    use bytes::Bytes;
    use tower_idempotency::{
        Fingerprint, IdempotencyLayer, Outcome, Scope, StoredResponse,
        job::{JobOutcome, JobRunner},
        store::{Claim, ClaimRequest, Fenced, Removal, SqlxStore, Store, StoreErrorKind},
    };

    use crate::common::{TestDatabase, TestSchema, app, post, send};

    fn request<'a>(scope: &'a Scope, key: &'a str, fingerprint: u8) -> ClaimRequest<'a> {
        ClaimRequest {
            scope,
            key,
            fingerprint: Fingerprint::new([fingerprint; 32]),
            lease: Duration::from_secs(30),
            ttl: Duration::from_secs(3600),
        }
    }

    /// The app's pool itself, handed to the layer and to the job runner (the store's
    /// default table, in a database of the test's own): each migrates it, runs the
    /// work once and replays it.
    #[tokio::test]
    async fn a_pool_handed_to_the_layer_and_the_runner_is_a_store() {
        let db = TestDatabase::new().await;
        let pool = super::pool(&db.url(), 4).await;
        let layer = IdempotencyLayer::new(pool.clone());
        layer.migrate().await.expect("migrate");
        let (router, counter) = app(layer);
        let first = send(&router, post("pay-1", r#"{"amount":1}"#)).await;
        let again = send(&router, post("pay-1", r#"{"amount":1}"#)).await;
        assert_eq!(first.status, 201);
        assert_eq!(again.status, first.status);
        assert_eq!(again.body, first.body);
        assert_eq!(again.outcome, Some(Outcome::Replayed));
        assert_eq!(counter.runs(), 1);

        let runner = JobRunner::new(pool.clone());
        runner.migrate().await.expect("migrate");
        let scope = Scope::new("consumer");
        let mut outcomes = Vec::new();
        for _ in 0..2 {
            let outcome = runner
                .run(&scope, "msg-1", b"payload", |_| async {
                    Ok::<_, std::io::Error>(Bytes::from_static(b"credited"))
                })
                .await
                .expect("a run");
            outcomes.push(outcome);
        }
        assert!(
            matches!(&outcomes[..], [JobOutcome::Ran(r), JobOutcome::AlreadyDone(d)] if r == "credited" && d == "credited"),
            "{outcomes:?}"
        );
        let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM public.idempotency_keys")
            .fetch_one(&pool)
            .await
            .expect("count");
        assert_eq!(rows, 2);
        pool.close().await;
    }

    /// One table, two drivers: what one completes the other replays byte for byte, a
    /// key one holds the other finds running, and a completion under a token the other
    /// took over is fenced.
    #[tokio::test]
    async fn both_drivers_share_one_table() {
        let schema = TestSchema::new();
        let sqlx_store = super::store(&schema).await;
        let pg_store = schema.store().await;
        let scope = Scope::new("acct");

        let Claim::Acquired(lease) = sqlx_store
            .claim(&request(&scope, "k1", 1))
            .await
            .expect("claim")
        else {
            panic!("a new key")
        };
        let response = StoredResponse {
            status: http::StatusCode::CREATED,
            headers: http::HeaderMap::from_iter([(
                http::header::CONTENT_TYPE,
                http::HeaderValue::from_static("application/json"),
            )]),
            body: Bytes::from_static(br#"{"id":"pay_1"}"#),
        };
        assert_eq!(
            pg_store
                .claim(&request(&scope, "k1", 1))
                .await
                .ok()
                .map(|c| matches!(c, Claim::Running { .. })),
            Some(true)
        );
        let kept = sqlx_store
            .complete(&lease, &response, Duration::from_secs(3600))
            .await
            .expect("complete");
        assert_eq!(kept, Fenced::Kept);
        match pg_store
            .claim(&request(&scope, "k1", 1))
            .await
            .expect("claim")
        {
            Claim::Completed {
                response: replayed,
                fingerprint,
            } => {
                assert_eq!(fingerprint, Fingerprint::new([1; 32]));
                assert_eq!(replayed.status, response.status);
                assert_eq!(replayed.headers, response.headers);
                assert_eq!(replayed.body, response.body);
            }
            other => panic!("completed expected, got {other:?}"),
        }

        // The other way round, with a lease that lapses at once: the sqlx store takes
        // it over, and the first holder's completion is fenced.
        let short = ClaimRequest {
            lease: Duration::from_millis(1),
            ..request(&scope, "k2", 2)
        };
        let Claim::Acquired(first) = pg_store.claim(&short).await.expect("claim") else {
            panic!("a new key")
        };
        let mut taken = None;
        for _ in 0..1000 {
            if let Claim::Acquired(lease) = sqlx_store
                .claim(&request(&scope, "k2", 2))
                .await
                .expect("claim")
            {
                taken = Some(lease);
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let taken = taken.expect("the lapsed lease taken over");
        assert!(taken.token > first.token);
        let fenced = pg_store
            .complete(&first, &response, Duration::from_secs(3600))
            .await
            .expect("complete");
        assert_eq!(fenced, Fenced::LeaseLost);
        assert_eq!(
            sqlx_store
                .renew(&first, Duration::from_secs(5))
                .await
                .expect("renew"),
            Fenced::LeaseLost
        );
        assert_eq!(
            sqlx_store
                .renew(&taken, Duration::from_secs(5))
                .await
                .expect("renew"),
            Fenced::Kept
        );
        assert_eq!(
            sqlx_store.release(&taken).await.expect("release"),
            Fenced::Kept
        );
        assert!(
            sqlx_store
                .look_up(&scope, "k2")
                .await
                .expect("look up")
                .is_none()
        );
        let record = sqlx_store
            .look_up(&scope, "k1")
            .await
            .expect("look up")
            .expect("k1");
        assert_eq!(record.token, lease.token);
    }

    /// An operator's actions on this driver: the running keys listed, a running key
    /// released only under the holder named, a completed one deleted, a running one
    /// refused, a missing one absent.
    #[tokio::test]
    async fn an_operator_lists_releases_and_deletes_keys() {
        let schema = TestSchema::new();
        let store = super::store(&schema).await;
        let scope = Scope::new("acct");
        let Claim::Acquired(running) = store
            .claim(&request(&scope, "run", 1))
            .await
            .expect("claim")
        else {
            panic!("a new key")
        };
        let Claim::Acquired(done) = store
            .claim(&request(&scope, "done", 2))
            .await
            .expect("claim")
        else {
            panic!("a new key")
        };
        let response = StoredResponse {
            status: http::StatusCode::OK,
            headers: http::HeaderMap::new(),
            body: Bytes::from_static(b"ok"),
        };
        let kept = store
            .complete(&done, &response, Duration::from_secs(60))
            .await
            .expect("complete");
        assert_eq!(kept, Fenced::Kept);

        let listed = store
            .running_keys(Duration::ZERO, 10)
            .await
            .expect("running keys");
        assert_eq!(listed.len(), 1, "{listed:?}");
        assert_eq!(listed[0].key, "run");
        assert_eq!(listed[0].record.token, running.token);

        let other = Some(running.token.next());
        assert!(matches!(
            store
                .release_running(&scope, "run", other)
                .await
                .expect("release"),
            Removal::Refused(_)
        ));
        assert!(matches!(
            store.delete_completed(&scope, "run").await.expect("delete"),
            Removal::Refused(_)
        ));
        assert!(matches!(
            store
                .release_running(&scope, "run", Some(running.token))
                .await
                .expect("release"),
            Removal::Removed { token } if token == running.token
        ));
        assert!(matches!(
            store
                .delete_completed(&scope, "done")
                .await
                .expect("delete"),
            Removal::Removed { token } if token == done.token
        ));
        assert!(matches!(
            store
                .delete_completed(&scope, "done")
                .await
                .expect("delete"),
            Removal::Absent
        ));
        assert!(
            store
                .look_up(&scope, "run")
                .await
                .expect("look up")
                .is_none()
        );
        assert_eq!(
            store
                .renew(&running, Duration::from_secs(5))
                .await
                .expect("renew"),
            Fenced::LeaseLost
        );
    }

    /// A store whose table was never migrated: the claim's error is classified by its
    /// SQLSTATE as the tokio-postgres driver's is, misconfigured, and says to migrate.
    #[tokio::test]
    async fn an_unmigrated_table_is_misconfigured_and_says_to_migrate() {
        let schema = TestSchema::new();
        let store = SqlxStore::new(super::pool(&crate::common::database_url(), 2).await)
            .with_schema_name(&schema.name)
            .expect("schema name");
        let scope = Scope::new("acct");
        let e = store
            .claim(&request(&scope, "k", 1))
            .await
            .expect_err("no table");
        assert_eq!(e.kind(), StoreErrorKind::Misconfigured);
        assert!(e.hint().is_some_and(|h| h.contains("migrate()")), "{e}");
    }

    /// A waiter on a store that listens is woken by the completion's notification
    /// (sent by the other driver's completion), not by a timer: with the listener up,
    /// `changed` resolves on a notification only.
    #[tokio::test]
    async fn a_waiter_is_woken_by_the_completion_s_notification() {
        let schema = TestSchema::new();
        let sqlx_store = Arc::new(super::store(&schema).await);
        let pg_store = schema.store().await;
        sqlx_store.listen().await.expect("listening");
        assert!(sqlx_store.is_listening());
        let scope = Scope::new("acct");
        let Claim::Acquired(lease) = pg_store
            .claim(&request(&scope, "k", 1))
            .await
            .expect("claim")
        else {
            panic!("a new key")
        };
        let changed = sqlx_store.changed(&scope, "k");
        assert!(
            sqlx_store
                .register_waiter(&scope, "k")
                .await
                .expect("register")
        );
        let response = StoredResponse {
            status: http::StatusCode::OK,
            headers: http::HeaderMap::new(),
            body: Bytes::from_static(b"done"),
        };
        let kept = pg_store
            .complete(&lease, &response, Duration::from_secs(60))
            .await
            .expect("complete");
        assert_eq!(kept, Fenced::Kept);
        tokio::time::timeout(Duration::from_secs(30), changed)
            .await
            .expect("woken by the notification");
    }
}

/// Lease mode's failures on this driver, each proven by really failing something
/// through the fault proxy: connections cut under the pool, a stalled database, a
/// completion that cannot reach the database.
mod faults {
    use std::time::Duration;

    use tower_idempotency::{IdempotencyLayer, Outcome, store::SqlxStore};

    use crate::common::{
        TestSchema, app, eventually, in_flight, post, post_with_headers, proxy::PgProxy,
        retry_until_created, row, send, send_bounded, wait_for_state,
    };

    /// A migrated store on `size` connections through `proxy`, listening there too.
    /// The pool does not ping a connection before lending it (sqlx's
    /// `test_before_acquire`), so that what the proxy cuts is the store's own statement.
    async fn store_through(schema: &TestSchema, proxy: &PgProxy, size: u32) -> SqlxStore {
        store_keeping(schema, proxy, size, 0).await
    }

    /// [`store_through`], keeping up to `kept` connections out of the pool.
    async fn store_keeping(
        schema: &TestSchema,
        proxy: &PgProxy,
        size: u32,
        kept: usize,
    ) -> SqlxStore {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(size)
            .test_before_acquire(false)
            .acquire_timeout(Duration::from_secs(2))
            .connect(&proxy.url())
            .await
            .expect("pool");
        let store = SqlxStore::new(pool)
            .with_kept_connections(kept)
            .with_schema_name(&schema.name)
            .expect("schema name");
        store.migrate().await.expect("migrate");
        store
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn cut_connections_answer_503_or_recover_and_never_run_a_key_twice() {
        cut_connections(0).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn cut_kept_connections_answer_503_or_recover_and_never_run_a_key_twice() {
        cut_connections(2).await;
    }

    async fn cut_connections(kept: usize) {
        let schema = TestSchema::new();
        let proxy = PgProxy::start().await;
        let store = store_keeping(&schema, &proxy, 4, kept).await;
        let (router, counter) = app(IdempotencyLayer::new(store));
        for i in 0..4 {
            let r = send(&router, post(&format!("k{i}"), "{}")).await;
            assert_eq!(r.status, 201);
        }
        proxy.cut();
        for i in 0..8 {
            let key = format!("k{i}");
            let mut answers = Vec::new();
            loop {
                let r = send(&router, post(&key, "{}")).await;
                answers.push(r.status.as_u16());
                if r.status == 201 {
                    break;
                }
                assert_eq!(r.status, 503, "{key}: {answers:?}");
                assert_eq!(r.problem(), "store-unavailable");
                assert!(answers.len() < 20, "{key} never recovered: {answers:?}");
            }
            assert_eq!(counter.runs_of(&key), 1, "{key}: {answers:?}");
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_stalled_database_is_a_bounded_503_then_recovers() {
        stalled_database(0).await;
    }

    /// On a kept connection: the statements after the stalled one are answered with
    /// their own replies, whether the stalled one was given up on (its connection
    /// closed) or finished late.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_stalled_database_on_kept_connections_is_a_bounded_503_then_recovers() {
        stalled_database(1).await;
    }

    async fn stalled_database(kept: usize) {
        let schema = TestSchema::new();
        let proxy = PgProxy::start().await;
        let store = store_keeping(&schema, &proxy, 2, kept).await;
        let layer = IdempotencyLayer::new(store.clone()).store_timeout(Duration::from_millis(300));
        let (router, counter) = app(layer);
        if kept > 0 {
            // The kept connection opened, and idle when the database stalls.
            assert_eq!(send(&router, post("warm-up", "{}")).await.status, 201);
            assert_eq!(store.kept_connections(), 1);
        }
        proxy.stall(true);
        let r = send_bounded(&router, post("k", "{}")).await;
        assert_eq!(r.status, 503);
        assert!(r.header("retry-after").is_some());
        assert_eq!(counter.runs_of("k"), 0);
        proxy.stall(false);
        // The stalled claim may land once the proxy lets it through (it then holds the
        // key until its lease lapses); either way the key is run exactly once.
        let mut statuses = Vec::new();
        loop {
            let r = send(&router, post("k", "{}")).await;
            statuses.push(r.status.as_u16());
            if r.status == 201 {
                break;
            }
            assert!(statuses.len() < 1000, "{statuses:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(counter.runs_of("k"), 1, "{statuses:?}");
    }

    /// A statement dropped before its answer (its caller gave up on it) closes the kept
    /// connection it was sent on: given back, that connection would hand the late answer
    /// to the next statement. The claims after it are answered as their own.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_statement_dropped_before_its_answer_closes_its_kept_connection() {
        use tower_idempotency::{
            Fingerprint, Scope,
            store::{Claim, ClaimRequest, Store},
        };

        let schema = TestSchema::new();
        let proxy = PgProxy::start().await;
        let store = store_keeping(&schema, &proxy, 2, 1).await;
        let scope = Scope::new("dropped");
        let request = |key: &'static str| ClaimRequest {
            scope: &scope,
            key,
            fingerprint: Fingerprint::new([1; 32]),
            lease: Duration::from_secs(30),
            ttl: Duration::from_secs(3600),
        };
        assert!(matches!(
            store.claim(&request("warm-up")).await,
            Ok(Claim::Acquired(_))
        ));
        assert_eq!(store.kept_connections(), 1);
        proxy.stall(true);
        let given_up =
            tokio::time::timeout(Duration::from_millis(300), store.claim(&request("k"))).await;
        assert!(given_up.is_err(), "the stalled claim was answered");
        assert_eq!(
            store.kept_connections(),
            0,
            "the connection of the dropped claim is closed"
        );
        proxy.stall(false);
        // The dropped claim may have landed: `k` is then running (or released by its
        // token); a new key is acquired, answered by its own reply.
        let fresh = store.claim(&request("k2")).await.expect("the next claim");
        let Claim::Acquired(lease) = fresh else {
            panic!("a new key is acquired, not {fresh:?}")
        };
        assert_eq!(&*lease.key, "k2");
        assert_eq!(store.kept_connections(), 1);
    }

    /// A claim's answer lost with its connection (the database refusing connections for
    /// a while after, if `away`) may have committed: it is released by its token, and a
    /// retry runs within seconds, not after the 60 s lease.
    async fn a_claim_lost_with_its_connection_is_released(away: bool) {
        let schema = TestSchema::new();
        let proxy = PgProxy::start().await;
        let store = store_through(&schema, &proxy, 1).await;
        let pool = store.pool().clone();
        let layer = IdempotencyLayer::new(store).lease_duration(Duration::from_secs(60));
        let (router, counter) = app(layer);
        // Prepares the statements: the claim is what the server answers next.
        assert_eq!(send(&router, post("warm-up", "{}")).await.status, 201);
        wait_for_state(&schema, "warm-up", "completed").await;
        // sqlx returns a connection to its pool in a task of its own, after a ping
        // through the proxy: once the pool's one connection is idle again, that ping
        // (the warm-up's last exchange) has been answered, and the next reply is the
        // claim's.
        eventually(|| pool.num_idle() == 1).await;
        proxy.cut_at_next_reply();
        proxy.refuse(away);
        let lost = send(&router, post("k", "{}")).await;
        assert_eq!(lost.status, 503);
        assert_eq!(counter.runs_of("k"), 0);
        if away {
            eventually(|| proxy.refused() > 0).await;
            proxy.refuse(false);
        }
        retry_until_created(&router, "k", &[409, 503]).await;
        assert_eq!(counter.runs_of("k"), 1);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_claim_whose_answer_was_lost_with_its_connection_is_released() {
        a_claim_lost_with_its_connection_is_released(false).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_claim_in_doubt_is_released_once_the_database_is_back() {
        a_claim_lost_with_its_connection_is_released(true).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_cut_while_the_handler_runs_still_stores_its_response() {
        let schema = TestSchema::new();
        let proxy = PgProxy::start().await;
        let store = store_through(&schema, &proxy, 4).await;
        let (router, counter) = app(IdempotencyLayer::new(store));
        let first = in_flight(
            &router,
            post_with_headers("k", &[("x-held", "1")]),
            &counter,
        )
        .await;
        proxy.cut();
        counter.let_go(1);
        let first = first.await.expect("the first request");
        assert_eq!(first.status, 201);
        wait_for_state(&schema, "k", "completed").await;
        let replay = send(&router, post("k", "{}")).await;
        assert_eq!(replay.outcome, Some(Outcome::Replayed));
        assert_eq!(replay.body, first.body);
        assert_eq!(counter.runs(), 1);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_failed_completion_is_retried_and_the_client_still_gets_its_response() {
        let schema = TestSchema::new();
        let proxy = PgProxy::start().await;
        let store = store_through(&schema, &proxy, 4).await;
        let layer = IdempotencyLayer::new(store)
            .store_timeout(Duration::from_millis(200))
            .lease_duration(Duration::from_secs(10));
        let shutdown = layer.shutdown_handle();
        let (router, counter) = app(layer);
        let first = in_flight(
            &router,
            post_with_headers("k", &[("x-held", "1")]),
            &counter,
        )
        .await;
        proxy.stall(true);
        counter.let_go(1);
        let first = first.await.expect("the first request");
        assert_eq!(first.status, 201);
        assert_eq!(
            row(&schema, "k").await.map(|r| r.0).as_deref(),
            Some("running")
        );
        assert_eq!(
            shutdown.in_flight(),
            1,
            "the completion is still being retried"
        );
        proxy.stall(false);
        wait_for_state(&schema, "k", "completed").await;
        eventually(|| shutdown.in_flight() == 0).await;
        let replay = send(&router, post("k", "{}")).await;
        assert_eq!(replay.outcome, Some(Outcome::Replayed));
        assert_eq!(replay.body, first.body);
        assert_eq!(counter.runs(), 1);
    }
}

/// Connections the store keeps out of the pool (`SqlxStore::with_kept_connections`):
/// the layer suite over them, statements that go over them while the app holds every
/// connection of its pool, one the server ended while idle tested and replaced, and a
/// pool closed under them.
mod kept {
    use std::{sync::Arc, time::Duration};

    use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
    use tower_idempotency::{IdempotencyLayer, store::SqlxStore};

    use crate::common::{TestSchema, app, database_url, post, send};

    mod layer {
        use std::sync::Arc;

        use tower_idempotency::store::Store;

        use crate::common::TestSchema;

        /// Two kept connections, fewer than the suite's concurrent requests: its
        /// statements go over both kept and pooled connections.
        async fn make() -> (Arc<dyn Store>, TestSchema) {
            let schema = TestSchema::new();
            let store = super::super::store(&schema).await.with_kept_connections(2);
            (Arc::new(store), schema)
        }

        crate::layer_suite!(make);
    }

    /// A store keeping up to `kept` connections, on a pool of `size` whose connections
    /// are named after `schema` (to be counted, and ended, on the server), taking at
    /// most 1 s to hand one out; it listens on a pool of its own.
    async fn store(schema: &TestSchema, size: u32, kept: usize) -> SqlxStore {
        let options: PgConnectOptions = database_url().parse().expect("url");
        let pool = PgPoolOptions::new()
            .max_connections(size)
            .acquire_timeout(Duration::from_secs(1))
            .connect_lazy_with(options.application_name(&schema.name));
        let store = SqlxStore::new(pool)
            .with_notification_pool(super::pool(&database_url(), 1).await)
            .with_kept_connections(kept)
            .with_schema_name(&schema.name)
            .expect("schema name");
        store.migrate().await.expect("migrate");
        store
    }

    /// The server's sessions of the store's pool and kept connections.
    async fn sessions(schema: &TestSchema) -> i64 {
        schema
            .query(&format!(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = '{}'",
                schema.name
            ))
            .await[0]
            .get(0)
    }

    /// With every connection of the pool held by the app, keys are still claimed,
    /// completed and replayed: over the kept connections, opened beyond the pool's
    /// `max_connections`. Without them, the same requests wait for the pool and fail.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn statements_go_over_kept_connections_while_the_app_holds_the_pool() {
        for kept in [0, 2] {
            let schema = TestSchema::new();
            let store = store(&schema, 2, kept).await;
            let (router, counter) = app(IdempotencyLayer::new(store.clone()));
            // Opens the kept connections, if any: two requests at once.
            let warm = tokio::join!(
                send(&router, post("warm-1", "{}")),
                send(&router, post("warm-2", "{}")),
            );
            assert_eq!((warm.0.status.as_u16(), warm.1.status.as_u16()), (201, 201));
            let held = [
                store.pool().acquire().await.expect("a connection"),
                store.pool().acquire().await.expect("a connection"),
            ];
            let mut statuses = Vec::new();
            for i in 0..10 {
                statuses.push(send(&router, post(&format!("k{i}"), "{}")).await.status);
            }
            let replay = send(&router, post("k0", "{}")).await;
            if kept == 0 {
                assert!(statuses.iter().all(|s| *s == 503), "{statuses:?}");
                assert_eq!(replay.status, 503);
                continue;
            }
            assert!(statuses.iter().all(|s| *s == 201), "{statuses:?}");
            assert_eq!(replay.status, 201);
            assert_eq!(counter.runs_of("k0"), 1);
            assert_eq!(counter.runs(), 12);
            assert!((1..=kept).contains(&store.kept_connections()));
            assert_eq!(
                sessions(&schema).await,
                (held.len() + store.kept_connections()) as i64,
                "the kept connections are outside the pool"
            );
            drop(held);
        }
    }

    /// Many tasks over a few keys, more at once than there are kept connections: each
    /// key runs once, every duplicate gets its response, the store never keeps more
    /// than it was given, and it waits for them rather than make the pool open more
    /// (the pool's one session is the migration's, if the kept ones did not take it).
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn concurrent_requests_share_the_kept_connections_and_run_each_key_once() {
        let schema = TestSchema::new();
        let store = store(&schema, 4, 3).await;
        let layer = IdempotencyLayer::new(store.clone()).wait_for_running(Duration::from_secs(10));
        let (router, counter) = app(layer);
        let barrier = Arc::new(tokio::sync::Barrier::new(48));
        let tasks: Vec<_> = (0..48)
            .map(|i| {
                let (router, barrier) = (router.clone(), barrier.clone());
                tokio::spawn(async move {
                    barrier.wait().await;
                    let key = format!("k{}", i % 8);
                    (key.clone(), send(&router, post(&key, "{}")).await)
                })
            })
            .collect();
        let mut first = std::collections::HashMap::new();
        for t in tasks {
            let (key, r) = t.await.expect("task");
            assert_eq!(r.status, 201, "{key}");
            let body = first.entry(key.clone()).or_insert_with(|| r.body.clone());
            assert_eq!(
                *body, r.body,
                "{key}: every duplicate gets the one response"
            );
        }
        for i in 0..8 {
            assert_eq!(counter.runs_of(&format!("k{i}")), 1);
        }
        assert!(store.kept_connections() <= 3);
        assert!(
            store.pool().size() <= 1,
            "the pool opened {} sessions for the store",
            store.pool().size()
        );
    }

    /// A kept connection whose session the server ended while it sat idle is tested
    /// before its next statement, closed and replaced: the request does not fail.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_kept_connection_ended_by_the_server_while_idle_is_replaced_unseen() {
        let schema = TestSchema::new();
        let store = store(&schema, 2, 1).await;
        let (router, counter) = app(IdempotencyLayer::new(store.clone()));
        assert_eq!(send(&router, post("warm-up", "{}")).await.status, 201);
        assert_eq!(store.kept_connections(), 1);
        let ended = schema
            .query(&format!(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                 WHERE application_name = '{}'",
                schema.name
            ))
            .await;
        assert!(!ended.is_empty(), "the kept connection's session was ended");
        // Idle for longer than a kept connection serves untested.
        tokio::time::sleep(Duration::from_millis(1200)).await;
        for i in 0..3 {
            let r = send(&router, post(&format!("k{i}"), "{}")).await;
            assert_eq!(r.status, 201, "{:?}", r.body);
        }
        assert_eq!(counter.runs(), 4);
        assert_eq!(store.kept_connections(), 1);
    }

    /// The app closing its pool does not wait for the store's kept connections, and
    /// closes them: the store's next statement finds the pool closed.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn closing_the_pool_closes_the_kept_connections_without_waiting_for_them() {
        let schema = TestSchema::new();
        let store = store(&schema, 2, 2).await;
        let (router, _counter) = app(IdempotencyLayer::new(store.clone()));
        assert_eq!(send(&router, post("k", "{}")).await.status, 201);
        assert_eq!(store.kept_connections(), 1);
        tokio::time::timeout(Duration::from_secs(5), store.pool().close())
            .await
            .expect("the pool closed without waiting for the store");
        let r = send(&router, post("k2", "{}")).await;
        assert_eq!(r.status, 503);
        assert_eq!(store.kept_connections(), 0);
        for _ in 0..100 {
            if sessions(&schema).await == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(
            sessions(&schema).await,
            0,
            "no session of the store is left"
        );
    }
}

/// Liveness on sqlx (`SqlxStore::with_liveness`): a killed holder's key is taken over
/// long before its lease lapses, by a claim or by the completer of a resumable route;
/// a live holder's never. Holders are this test binary started again with
/// `TI_SQLX_CHILD` naming what it runs, and killed with SIGKILL.
mod liveness {
    use std::{
        io::{BufRead, BufReader},
        process::{Child, Command, Stdio},
        sync::mpsc,
        time::Duration,
    };

    use axum::{Router, routing::post};
    use http::{StatusCode, header::CONTENT_TYPE};
    use tower_idempotency::{
        Fingerprint, IdempotencyLayer, Outcome, Scope,
        store::{Claim, ClaimRequest, SqlxStore, Store},
    };

    use crate::common::{
        Counter, TestSchema, app, create, database_url, eventually, post_with_headers, send,
    };

    /// A lease far longer than the tests run: only liveness could take the key over.
    const LONG_LEASE: Duration = Duration::from_secs(600);

    fn request<'a>(scope: &'a Scope, key: &'a str) -> ClaimRequest<'a> {
        ClaimRequest {
            scope,
            key,
            fingerprint: Fingerprint::new([7; 32]),
            lease: LONG_LEASE,
            ttl: Duration::from_secs(3600),
        }
    }

    /// A store with liveness on `schema`, holding its lock.
    async fn live_store(schema: &str) -> SqlxStore {
        let store = SqlxStore::new(super::pool(&database_url(), 4).await)
            .with_schema_name(schema)
            .expect("schema")
            .with_liveness(true);
        store.start_liveness().await.expect("liveness");
        store
    }

    /// This test binary, started again to run `role` on `schema` and `key`; killed
    /// when dropped.
    struct Holder {
        child: Child,
        lines: mpsc::Receiver<String>,
    }

    impl Holder {
        fn start(role: &str, schema: &TestSchema, key: &str) -> Self {
            let mut child = Command::new(std::env::current_exe().expect("the test binary"))
                .args([
                    "--exact",
                    "liveness::child",
                    "--nocapture",
                    "--test-threads=1",
                ])
                .env("TI_SQLX_CHILD", role)
                .env("TI_SQLX_SCHEMA", &schema.name)
                .env("TI_SQLX_KEY", key)
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
            Self { child, lines }
        }

        /// Waits (at most 60 s: a bound, not a timing claim) for the child to print
        /// `word`.
        fn wait_for(&self, word: &str) {
            loop {
                match self.lines.recv_timeout(Duration::from_secs(60)) {
                    Ok(line) if line.contains(word) => return,
                    Ok(_) => {}
                    Err(e) => panic!("the holder never printed {word:?}: {e}"),
                }
            }
        }

        fn kill9(&mut self) {
            self.child.kill().expect("SIGKILL the holder");
            self.child.wait().expect("the holder ends");
        }
    }

    impl Drop for Holder {
        fn drop(&mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }

    /// What a holder process runs, by `TI_SQLX_CHILD`: `claim` claims the key for
    /// `LONG_LEASE`; `resumable` sends a request with it through a resumable layer,
    /// whose handler never returns. Either prints `holding the key` and waits to be killed.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn child() {
        let Ok(role) = std::env::var("TI_SQLX_CHILD") else {
            return;
        };
        let schema = std::env::var("TI_SQLX_SCHEMA").expect("schema");
        let key = std::env::var("TI_SQLX_KEY").expect("key");
        let store = live_store(&schema).await;
        match role.as_str() {
            "claim" => {
                let scope = Scope::anonymous();
                let claim = store.claim(&request(&scope, &key)).await.expect("claim");
                assert!(matches!(claim, Claim::Acquired(_)), "{claim:?}");
            }
            "resumable" => {
                let layer = IdempotencyLayer::new(store).resumable("payments", [CONTENT_TYPE]);
                let (router, counter) = app(layer);
                tokio::spawn(async move {
                    send(&router, post_with_headers(&key, &[("x-held", "1")])).await
                });
                eventually(|| counter.runs() == 1).await;
            }
            other => panic!("no such role {other:?}"),
        }
        println!("\nholding the key");
        std::future::pending::<()>().await;
    }

    /// `(state, token, holder)` of `key`'s row.
    async fn row(schema: &TestSchema, key: &str) -> (String, i64, Option<i64>) {
        let rows = schema
            .query(&format!(
                "SELECT state, token, holder FROM \"{}\".idempotency_keys WHERE key = '{key}'",
                schema.name
            ))
            .await;
        let r = rows.first().expect("the key's row");
        (r.get(0), r.get(1), r.get(2))
    }

    /// Before `migrate()`, the lock's connection cannot register, and `start_liveness`
    /// says why, with the database's words and what to do; once migrated, the same
    /// store holds its lock (its connection kept trying in the background).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn start_liveness_says_why_before_migrate_and_holds_after() {
        use tower_idempotency::store::StoreErrorKind;
        let schema = TestSchema::new();
        let store = SqlxStore::new(super::pool(&database_url(), 4).await)
            .with_schema_name(&schema.name)
            .expect("schema")
            .with_liveness(true);
        let e = store
            .start_liveness()
            .await
            .expect_err("registered before migrate()");
        assert_eq!(e.kind(), StoreErrorKind::Misconfigured, "{e}");
        assert!(e.to_string().contains("did not hold its lock"), "{e}");
        assert!(e.to_string().contains("_holders"), "{e}");
        assert!(e.hint().is_some_and(|h| h.contains("migrate")), "{e:?}");
        assert!(!store.is_live());
        store.migrate().await.expect("migrate");
        store
            .start_liveness()
            .await
            .expect("liveness once migrated");
        assert!(store.is_live());
    }

    /// Claims of a live holder's key find it running for several times the grace (1 s)
    /// after which a silent holder whose lock is free counts as gone; once the holder
    /// is killed, a claim takes the key over (the next token, this store as its holder)
    /// while its 10-minute lease has nearly all its time to run.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_killed_holder_s_key_is_taken_over_and_a_live_one_s_never() {
        let schema = TestSchema::new();
        super::store(&schema).await;
        let store = live_store(&schema.name).await;
        let mut holder = Holder::start("claim", &schema, "held");
        holder.wait_for("holding the key");
        let (state, token, dead) = row(&schema, "held").await;
        assert_eq!(state, "running");
        assert!(dead.is_some() && dead != store.holder_id(), "{dead:?}");
        let scope = Scope::anonymous();
        for _ in 0..12 {
            let claim = store.claim(&request(&scope, "held")).await.expect("claim");
            assert!(matches!(claim, Claim::Running { .. }), "{claim:?}");
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        holder.kill9();
        let mut claims = 0;
        let lease = loop {
            match store.claim(&request(&scope, "held")).await.expect("claim") {
                Claim::Acquired(lease) => break lease,
                Claim::Running { .. } => claims += 1,
                other => panic!("unexpected claim: {other:?}"),
            }
            assert!(claims < 1500, "never taken over");
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        assert_eq!(lease.token.get(), token + 1);
        assert_eq!(row(&schema, "held").await.2, store.holder_id());
        assert_eq!(store.gone_holder_takeovers(), 1);
    }

    /// The completer of a resumable route over sqlx leaves a live holder's key alone,
    /// and once that holder's process is killed, takes it over and runs it to its
    /// end with no client retrying: a later request with the key replays it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_completer_finishes_a_killed_holder_s_key() {
        let schema = TestSchema::new();
        super::store(&schema).await;
        let layer = IdempotencyLayer::new(live_store(&schema.name).await)
            .resumable("payments", [CONTENT_TYPE]);
        let counter = Counter::default();
        let completer = layer.spawn_completer(
            Router::new()
                .route("/payments", post(create))
                .with_state(counter.clone()),
        );
        let mut holder = Holder::start("resumable", &schema, "resumed");
        holder.wait_for("holding the key");
        let (state, token, _) = row(&schema, "resumed").await;
        assert_eq!(state, "running");
        for _ in 0..10 {
            tokio::time::sleep(Duration::from_millis(250)).await;
            assert_eq!(row(&schema, "resumed").await.1, token);
        }
        assert_eq!(counter.runs(), 0, "a live holder's key was run");
        holder.kill9();
        let mut finished = false;
        for _ in 0..600 {
            if row(&schema, "resumed").await.0 == "completed" {
                finished = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(finished, "the dead holder's key was never finished");
        assert_eq!(row(&schema, "resumed").await.1, token + 1);
        assert_eq!(counter.runs(), 1);
        let (router, again) = app(layer);
        let replay = send(&router, post_with_headers("resumed", &[])).await;
        assert_eq!(replay.outcome, Some(Outcome::Replayed));
        assert_eq!(replay.status, StatusCode::CREATED);
        assert_eq!(again.runs(), 0);
        completer.abort();
    }
}

/// A table in generations on sqlx (`SqlxStore::with_generations`): the key cases of
/// tests/generations.rs, by the same rotation over the app's pool.
#[allow(clippy::unwrap_used)] // unwrap in the tests themselves: a failure is the test failing
mod generations {
    use std::{
        sync::{
            Arc,
            atomic::{AtomicBool, Ordering},
        },
        time::Duration,
    };

    use tower_idempotency::{
        Fingerprint, IdempotencyLayer, Outcome, Scope, StoredResponse,
        store::{Claim, ClaimRequest, SqlxStore, Store, StoreErrorKind},
    };

    use crate::common::{self, TestSchema, database_url, pooler_url, send};

    /// A period so short that every rotation starts a generation.
    const EVERY_TIME: Duration = Duration::from_millis(1);

    /// A migrated store in generations, with no background purge (the tests rotate by
    /// hand), on a pool of `size` connections (through the transaction pooler if
    /// `TI_POOLER_URL` names one).
    async fn store(schema: &TestSchema, size: u32) -> SqlxStore {
        let store = match pooler_url() {
            Some(pooler) => SqlxStore::new(super::pool(&pooler, size).await)
                .with_transaction_pooling(true)
                .with_notification_pool(super::pool(&database_url(), 1).await),
            None => SqlxStore::new(super::pool(&database_url(), size).await),
        };
        let store = store
            .with_schema_name(&schema.name)
            .expect("schema name")
            .with_background_purge(None)
            .with_generations(EVERY_TIME);
        store.migrate().await.expect("migrate");
        store
    }

    /// How many rows `key` has, in all generations.
    async fn rows_of(schema: &TestSchema, key: &str) -> i64 {
        schema
            .query(&format!(
                "SELECT count(*) FROM \"{}\".idempotency_keys WHERE key = '{key}'",
                schema.name
            ))
            .await[0]
            .get(0)
    }

    /// The generation `key`'s row is in.
    async fn generation_of(schema: &TestSchema, key: &str) -> i64 {
        schema
            .query(&format!(
                "SELECT generation FROM \"{}\".idempotency_keys WHERE key = '{key}'",
                schema.name
            ))
            .await[0]
            .get(0)
    }

    /// The partitions attached to the table.
    async fn partitions(schema: &TestSchema) -> Vec<String> {
        schema
            .query(&format!(
                "SELECT c.relname::text FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
                 WHERE i.inhparent = '\"{}\".idempotency_keys'::regclass ORDER BY c.relname",
                schema.name
            ))
            .await
            .iter()
            .map(|r| r.get(0))
            .collect()
    }

    fn request<'a>(scope: &'a Scope, key: &'a str, ttl: Duration) -> ClaimRequest<'a> {
        ClaimRequest {
            scope,
            key,
            fingerprint: Fingerprint::new([7; 32]),
            lease: Duration::from_secs(60),
            ttl,
        }
    }

    /// Claims and completes `key` with `ttl` and `body`.
    async fn completed(store: &SqlxStore, key: &str, ttl: Duration, body: &'static str) {
        let scope = Scope::anonymous();
        let Claim::Acquired(lease) = store.claim(&request(&scope, key, ttl)).await.unwrap() else {
            panic!("{key} is new");
        };
        let response = StoredResponse {
            status: http::StatusCode::CREATED,
            headers: http::HeaderMap::new(),
            body: body.into(),
        };
        assert!(
            store
                .complete(&lease, &response, ttl)
                .await
                .unwrap()
                .is_kept()
        );
    }

    /// Keys claimed and completed in one generation replay from it once another
    /// started, and a completed key claimed again is replayed, never inserted into the
    /// newest generation.
    #[tokio::test]
    async fn a_key_completed_before_a_rotation_replays_after_it_and_stays_one_row() {
        let schema = TestSchema::new();
        let store = store(&schema, 4).await;
        store.migrate().await.expect("migrate again");
        assert_eq!(partitions(&schema).await, ["idempotency_keys_g1"]);

        let hour = Duration::from_secs(3600);
        completed(&store, "first", hour, "one").await;
        assert_eq!(generation_of(&schema, "first").await, 1);
        tokio::time::sleep(Duration::from_millis(5)).await;
        let rotation = store.rotate_generations().await.unwrap();
        assert_eq!(rotation.started, Some(2));
        assert!(rotation.dropped.is_empty(), "{rotation:?}");
        completed(&store, "second", hour, "two").await;
        assert_eq!(generation_of(&schema, "second").await, 2);

        let scope = Scope::anonymous();
        for (key, body) in [("first", "one"), ("second", "two")] {
            match store.claim(&request(&scope, key, hour)).await.unwrap() {
                Claim::Completed { response, .. } => assert_eq!(response.body, body),
                other => panic!("{key}: {other:?}"),
            }
        }
        assert_eq!(rows_of(&schema, "first").await, 1);
        assert_eq!(generation_of(&schema, "first").await, 1);
    }

    /// A generation whose rows all expired is emptied and its partition dropped; one
    /// holding an unexpired row stays; a key whose generation went is new again.
    #[tokio::test]
    async fn a_rotation_empties_and_drops_a_generation_once_its_rows_expired() {
        let schema = TestSchema::new();
        let store = store(&schema, 4).await.remember_keys_for(Duration::ZERO);
        completed(&store, "kept", Duration::from_secs(3600), "k").await;
        tokio::time::sleep(Duration::from_millis(5)).await;
        assert_eq!(store.rotate_generations().await.unwrap().started, Some(2));
        completed(&store, "brief", Duration::from_millis(20), "b").await;
        assert_eq!(generation_of(&schema, "brief").await, 2);
        tokio::time::sleep(Duration::from_millis(50)).await;

        let rotation = store.rotate_generations().await.unwrap();
        assert_eq!(rotation.started, Some(3));
        assert_eq!(rotation.emptied, [2], "{rotation:?}");
        assert_eq!(rotation.dropped, [2], "{rotation:?}");
        assert_eq!(
            partitions(&schema).await,
            ["idempotency_keys_g1", "idempotency_keys_g3"]
        );
        assert_eq!(rows_of(&schema, "brief").await, 0);
        assert_eq!(rows_of(&schema, "kept").await, 1);

        let scope = Scope::anonymous();
        let again = request(&scope, "brief", Duration::from_secs(60));
        assert!(matches!(
            store.claim(&again).await.unwrap(),
            Claim::Acquired(_)
        ));
        assert_eq!(generation_of(&schema, "brief").await, 3);
    }

    /// One table in generations, both drivers: each replays what the other completed,
    /// across rotations made by either, which take turns by the same lock.
    #[tokio::test]
    async fn both_drivers_serve_and_rotate_one_table_in_generations() {
        let schema = TestSchema::new();
        let sqlx_store = store(&schema, 4).await;
        let pg_store = schema
            .store()
            .await
            .with_background_purge(None)
            .with_generations(EVERY_TIME);
        pg_store.migrate().await.expect("migrate");
        let hour = Duration::from_secs(3600);
        completed(&sqlx_store, "by-sqlx", hour, "s").await;
        tokio::time::sleep(Duration::from_millis(5)).await;
        assert_eq!(
            pg_store.rotate_generations().await.unwrap().started,
            Some(2)
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
        assert_eq!(
            sqlx_store.rotate_generations().await.unwrap().started,
            Some(3)
        );

        let scope = Scope::anonymous();
        let Claim::Acquired(lease) = pg_store
            .claim(&request(&scope, "by-pg", hour))
            .await
            .unwrap()
        else {
            panic!("a new key")
        };
        let response = StoredResponse {
            status: http::StatusCode::CREATED,
            headers: http::HeaderMap::new(),
            body: "p".into(),
        };
        assert!(
            pg_store
                .complete(&lease, &response, hour)
                .await
                .unwrap()
                .is_kept()
        );
        assert_eq!(generation_of(&schema, "by-pg").await, 3);
        for (store, key, body) in [
            (&pg_store as &dyn Store, "by-sqlx", "s"),
            (&sqlx_store as &dyn Store, "by-pg", "p"),
        ] {
            match store.claim(&request(&scope, key, hour)).await.unwrap() {
                Claim::Completed { response, .. } => assert_eq!(response.body, body),
                other => panic!("{key}: {other:?}"),
            }
            assert_eq!(rows_of(&schema, key).await, 1);
        }
    }

    /// The background purge of a store in generations rotates them: started at the
    /// first claim, it starts new generations and drops the emptied ones, rather than
    /// deleting rows.
    #[tokio::test]
    async fn the_background_purge_rotates() {
        let schema = TestSchema::new();
        let store = store(&schema, 4)
            .await
            .remember_keys_for(Duration::ZERO)
            .with_background_purge(Some(Duration::from_millis(10)));
        completed(&store, "brief", Duration::from_millis(1), "b").await;
        // Stored in generation 1, unless the purge (every 10 ms from the first claim)
        // has already taken it with its generation by the time it is read.
        let stored = schema
            .query(&format!(
                "SELECT generation FROM \"{}\".idempotency_keys WHERE key = 'brief'",
                schema.name
            ))
            .await;
        let generation = stored.first().map(|row| row.get::<_, i64>(0));
        assert!(matches!(generation, None | Some(1)), "{generation:?}");
        // Waits (up to 10 s) for generation 1 to go with its expired row.
        for _ in 0..1000 {
            if !partitions(&schema)
                .await
                .contains(&"idempotency_keys_g1".to_owned())
            {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let left = partitions(&schema).await;
        assert!(
            !left.contains(&"idempotency_keys_g1".to_owned()),
            "{left:?}"
        );
        assert!(!left.is_empty(), "the newest generation stays");
        assert_eq!(rows_of(&schema, "brief").await, 0);
    }

    /// A plain table of the name cannot be turned into generations in place: migrating
    /// a store built with them over it is refused, and changes nothing.
    #[tokio::test]
    async fn a_plain_table_is_refused() {
        let schema = TestSchema::new();
        let plain = super::store(&schema).await;
        let e = plain
            .with_generations(EVERY_TIME)
            .migrate()
            .await
            .expect_err("a plain table");
        assert_eq!(e.kind(), StoreErrorKind::Misconfigured, "{e}");
        assert!(e.to_string().contains("plain table"), "{e}");
    }

    /// 100 requests with one key at once, over three stores (pools), in rounds of a
    /// fresh key each, while a fourth store rotates the generations under them: one
    /// run per key, its response to the others (or 409), one row across generations.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn duplicates_run_once_while_generations_rotate() {
        let schema = TestSchema::new();
        let mut routers = Vec::new();
        for _ in 0..3 {
            routers.push(common::app(IdempotencyLayer::new(store(&schema, 8).await)));
        }
        let stop = Arc::new(AtomicBool::new(false));
        let rotator = {
            let (store, stop) = (store(&schema, 2).await, stop.clone());
            tokio::spawn(async move {
                let mut started = 0;
                while !stop.load(Ordering::SeqCst) {
                    if let Ok(rotation) = store.rotate_generations().await {
                        started += usize::from(rotation.started.is_some());
                    }
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
                started
            })
        };
        for round in 0..3 {
            let key = format!("race-{round}");
            let barrier = Arc::new(tokio::sync::Barrier::new(100));
            let tasks: Vec<_> = (0..100)
                .map(|i| {
                    let router = routers[i % routers.len()].0.clone();
                    let (barrier, key) = (barrier.clone(), key.clone());
                    tokio::spawn(async move {
                        let r = common::req("POST")
                            .header("idempotency-key", &key)
                            .header("x-delay-ms", "20")
                            .body(axum::body::Body::from("{}"))
                            .unwrap();
                        barrier.wait().await;
                        send(&router, r).await
                    })
                })
                .collect();
            let mut bodies = Vec::new();
            for t in tasks {
                let r = t.await.unwrap();
                match r.status.as_u16() {
                    201 => bodies.push((r.outcome, r.body)),
                    409 => assert_eq!(r.problem(), "in-progress"),
                    other => panic!("unexpected {other}: {:?}", r.body),
                }
            }
            let runs: usize = routers.iter().map(|(_, c)| c.runs_of(&key)).sum();
            assert_eq!(runs, 1, "{key}: the handler ran {runs} times");
            assert!(bodies.iter().all(|(_, b)| *b == bodies[0].1));
            let executed = bodies
                .iter()
                .filter(|(o, _)| *o == Some(Outcome::Executed))
                .count();
            assert_eq!(executed, 1);
            assert_eq!(rows_of(&schema, &key).await, 1);
        }
        stop.store(true, Ordering::SeqCst);
        assert!(
            rotator.await.unwrap() > 0,
            "no generation started under the races"
        );
    }
}
