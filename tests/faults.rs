//! Failure modes of lease mode, each proven by really failing something: connections
//! cut under the pool, a stalled database, a zombie holder whose renewals cannot reach
//! the database, a client that hangs up, a graceful shutdown.

mod common;

use std::{sync::Arc, time::Duration};

use axum::{Router, body::Body, extract::State, routing::post as post_route};
use common::{
    TestSchema, app, eventually, in_flight, post, post_with_headers, proxy::PgProxy, req,
    retry_until_created, row, send, wait_for_state,
};
use tokio::io::AsyncWriteExt;
use tower_idempotency::{
    Fingerprint, IdempotencyLayer, Outcome, Scope,
    store::{BoxFuture, Claim, ClaimRequest, PostgresStore, Store, pool_for_url},
};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cut_connections_answer_503_or_recover_and_never_run_a_key_twice() {
    cut_connections_answer_503_or_recover(0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cut_shared_claim_connections_answer_503_or_recover_and_never_run_a_key_twice() {
    cut_connections_answer_503_or_recover(2).await;
}

async fn cut_connections_answer_503_or_recover(shared_claim_connections: usize) {
    let schema = TestSchema::new();
    let proxy = PgProxy::start().await;
    let store = common::sharing_claims(
        schema.store_at(&proxy.url(), 4).await,
        shared_claim_connections,
    );
    let (router, counter) = app(IdempotencyLayer::new(store.clone()));
    for i in 0..4 {
        assert_eq!(
            send(&router, post(&format!("k{i}"), "{}")).await.status,
            201
        );
    }
    proxy.cut();
    // Every key, old and new, is retried until it answers 201; whatever the cut did to
    // the first attempts (503 on a dead connection), nothing runs twice.
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
    let shared = store.metrics().shared_claims;
    assert_eq!(
        shared > 0,
        shared_claim_connections > 0,
        "{shared} shared claims"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cut_while_the_handler_runs_still_stores_its_response() {
    let schema = TestSchema::new();
    let proxy = PgProxy::start().await;
    let store = schema.store_at(&proxy.url(), 4).await;
    let (router, counter) = app(IdempotencyLayer::new(store));
    let held = post_with_headers("k", &[("x-held", "1")]);
    let first = in_flight(&router, held, &counter).await;
    proxy.cut();
    counter.let_go(1);
    let first = first.await.unwrap();
    assert_eq!(first.status, 201);
    wait_for_state(&schema, "k", "completed").await;
    let replay = send(&router, post("k", "{}")).await;
    assert_eq!(replay.outcome, Some(Outcome::Replayed));
    assert_eq!(replay.body, first.body);
    assert_eq!(counter.runs(), 1);
}

#[tokio::test]
async fn a_stalled_database_is_a_bounded_503_then_recovers() {
    stalled_database_is_a_bounded_503_then_recovers(0).await;
}

#[tokio::test]
async fn a_stalled_database_is_a_bounded_503_then_recovers_with_shared_claim_connections() {
    stalled_database_is_a_bounded_503_then_recovers(2).await;
}

async fn stalled_database_is_a_bounded_503_then_recovers(shared_claim_connections: usize) {
    let schema = TestSchema::new();
    let proxy = PgProxy::start().await;
    let store = common::sharing_claims(
        schema.store_at(&proxy.url(), 2).await,
        shared_claim_connections,
    );
    let layer = IdempotencyLayer::new(store.clone()).store_timeout(Duration::from_millis(300));
    let (router, counter) = app(layer);
    proxy.stall(true);
    let r = common::send_bounded(&router, post("k", "{}")).await;
    assert_eq!(r.status, 503);
    assert!(r.header("retry-after").is_some());
    assert_eq!(counter.runs(), 0);
    proxy.stall(false);
    // The stalled claim may land once the proxy lets it through; either way the key is
    // then run exactly once.
    let mut statuses = Vec::new();
    loop {
        let r = send(&router, post("k", "{}")).await;
        statuses.push(r.status.as_u16());
        if r.status == 201 {
            break;
        }
        assert!(statuses.len() < 100, "{statuses:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(counter.runs() <= 1, "{statuses:?}");
    let shared = store.metrics().shared_claims;
    assert_eq!(
        shared > 0,
        shared_claim_connections > 0,
        "{shared} shared claims"
    );
}

/// A claim whose answer is lost with its connection may have committed. Its row is
/// released by the token the claim was sent with, so that a retry runs at once instead
/// of finding the key running, with nobody to run it, until the lease lapses.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_claim_whose_answer_was_lost_with_its_connection_is_released() {
    a_claim_lost_with_its_connection_is_released(false).await;
}

/// The database that lost a claim's answer is often still away when the release is
/// first tried (a crash, a failover): the release is tried again until it is back,
/// and the retry runs within seconds, not after the 60 s lease.
#[tokio::test]
async fn a_claim_in_doubt_is_released_once_the_database_is_back() {
    a_claim_lost_with_its_connection_is_released(true).await;
}

/// A claim's answer lost with its connection, the database refusing connections for a
/// while after if `away`; then a retry runs within seconds, not after the 60 s lease.
async fn a_claim_lost_with_its_connection_is_released(away: bool) {
    let schema = TestSchema::new();
    let proxy = PgProxy::start().await;
    let store = schema.store_at(&proxy.url(), 1).await;
    let layer = IdempotencyLayer::new(store).lease_duration(Duration::from_secs(60));
    let (router, counter) = app(layer);
    // Prepares the statements: the claim is what the server answers next.
    assert_eq!(send(&router, post("warm-up", "{}")).await.status, 201);
    proxy.cut_at_next_reply();
    proxy.refuse(away);
    let lost = send(&router, post("k", "{}")).await;
    assert_eq!(lost.status, 503);
    assert_eq!(counter.runs_of("k"), 0);
    if away {
        // The first release found the database away.
        eventually(|| proxy.refused() > 0).await;
        proxy.refuse(false);
    }
    retry_until_created(&router, "k", &[409, 503]).await;
    assert_eq!(counter.runs_of("k"), 1);
}

/// A shared claim connection dropped without a word (forgotten by a NAT: nothing fails,
/// nothing arrives) is forgotten in turn once a claim on it goes unanswered for a
/// second: the claims after it open a new shared connection and run, instead of
/// queuing behind it, or going to the pool while the claims stuck on it fill its
/// slot, until TCP gives up, many minutes later.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_silently_dropped_shared_claim_connection_is_replaced() {
    let schema = TestSchema::new();
    // Migrated on a pool of its own: nothing but the shared connection goes through
    // the proxy when it drops them.
    schema.store().await;
    let proxy = PgProxy::start().await;
    let store = schema
        .unmigrated_store_at(&proxy.url())
        .with_shared_claim_connections(1);
    let scope = Scope::anonymous();
    let warm_up = ClaimRequest {
        scope: &scope,
        key: "warm-up",
        fingerprint: Fingerprint::new([0; 32]),
        lease: Duration::from_secs(60),
        ttl: Duration::from_secs(60),
    };
    assert!(matches!(
        store.claim(&warm_up).await.unwrap(),
        Claim::Acquired(_)
    ));
    assert_eq!(store.pool().status().size, 0, "only the shared connection");
    proxy.blackhole();

    let layer = IdempotencyLayer::new(store.clone()).store_timeout(Duration::from_millis(300));
    let (router, counter) = app(layer);
    // As many claims at once as the connection takes: each is answered 503 at the
    // store timeout, and stays stuck on it, for as long as the kernel keeps it.
    let stuck: Vec<_> = (0..8)
        .map(|i| {
            let router = router.clone();
            tokio::spawn(async move { send(&router, post(&format!("stuck-{i}"), "{}")).await })
        })
        .collect();
    for r in stuck {
        assert_eq!(r.await.unwrap().status, 503);
    }
    assert_eq!(store.metrics().shared_claims, 9);
    // A second after they were sent, each of them has given the connection up (nothing
    // outside the store shows it: a pause of three times that).
    tokio::time::sleep(Duration::from_secs(3)).await;
    let ran = send(&router, post("k", "{}")).await;
    assert_eq!(ran.status, 201);
    assert_eq!(counter.runs_of("k"), 1);
    assert_eq!(counter.runs(), 1);
    // It was dealt to a new shared connection, not sent to the pool because the
    // stuck claims kept the slot looking full.
    assert_eq!(store.metrics().shared_claims, 10);
}

/// Pooled connections dropped without a word (forgotten overnight by a NAT) are not
/// handed out again and again: a statement given up on closes its connection, and a
/// claim given up on is waited for one lease at most. New connections then serve,
/// instead of every request answering 503 until TCP gives up, many minutes later.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn silently_dropped_pooled_connections_are_replaced() {
    let (idle_before, answers) = answers_over_a_dead_pool(Duration::from_secs(1)).await;
    assert_eq!(idle_before, 2);
    assert_eq!(answers[0], 503, "the first request met a dead connection");
}

/// Requests on new keys, 200 ms apart, through a layer with `lease` whose pool of two
/// connections were both opened, left idle, and then blackholed: each is answered 503
/// or, at last, 201 having run once. Returns the pool's size before the blackhole, and
/// the statuses, the last a 201.
async fn answers_over_a_dead_pool(lease: Duration) -> (usize, Vec<u16>) {
    let schema = TestSchema::new();
    schema.store().await;
    let proxy = PgProxy::start().await;
    let store = PostgresStore::new(pool_for_url(&proxy.url(), 2).expect("pool"))
        .with_schema_name(&schema.name)
        .expect("schema name");
    // Both of the pool's connections open, idle, then dead.
    let (a, b) = tokio::join!(store.pool().get(), store.pool().get());
    drop((a.expect("a connection"), b.expect("a connection")));
    let idle_before = store.pool().status().size;
    proxy.blackhole();

    let layer = IdempotencyLayer::new(store.clone())
        .store_timeout(Duration::from_millis(300))
        .lease_duration(lease);
    let (router, counter) = app(layer);
    let mut answers = Vec::new();
    for i in 0..60 {
        let key = format!("k{i}");
        let reply = send(&router, post(&key, "{}")).await;
        answers.push(reply.status.as_u16());
        if reply.status == 201 {
            assert_eq!(counter.runs_of(&key), 1);
            break;
        }
        assert_eq!(reply.status, 503);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(answers.last(), Some(&201), "{answers:?}");
    (idle_before, answers)
}

/// The same with a lease far longer than the test: a claim given up on while stuck on
/// a dead connection gives it back seconds after (`abandoned_claim_wait`), releasing in
/// doubt what may have landed, instead of holding it for its lease with the pool full.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_claim_stuck_on_a_dead_connection_gives_it_back_long_before_its_lease_lapses() {
    answers_over_a_dead_pool(Duration::from_secs(600)).await;
}

/// A claim held up on its way (a stalled network) past its caller's store timeout and
/// the store's wait for abandoned claims lands only after it was dropped: it is
/// released in doubt, by its token, so the retry runs, instead of meeting 409 for the
/// claim's whole lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_claim_that_lands_after_it_was_abandoned_is_released() {
    let schema = TestSchema::new();
    let proxy = PgProxy::start().await;
    let store = schema.store_at(&proxy.url(), 4).await;
    let layer = IdempotencyLayer::new(store.clone())
        .store_timeout(Duration::from_millis(300))
        .lease_duration(Duration::from_secs(600));
    let (router, counter) = app(layer);
    // The claim statement prepared on the pool's connection, so that the claim below
    // goes out whole, in one write.
    assert_eq!(send(&router, post("warm", "{}")).await.status, 201);
    let open = store.pool().status().size;
    proxy.stall(true);
    assert_eq!(send(&router, post("k", "{}")).await.status, 503);
    // The claim is dropped (its connection closed, leaving the pool) once the store
    // stops waiting for it.
    for _ in 0..1500 {
        if store.pool().status().size < open.max(1) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        store.pool().status().size < open.max(1),
        "the abandoned claim still holds its connection"
    );
    // Now it lands, held by the proxy until here.
    proxy.stall(false);
    let created = retry_until_created(&router, "k", &[409]).await;
    assert_eq!(created.status, 201);
    assert_eq!(counter.runs_of("k"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failed_completion_is_retried_and_the_client_still_gets_its_response() {
    let schema = TestSchema::new();
    let proxy = PgProxy::start().await;
    let store = schema.store_at(&proxy.url(), 4).await;
    let layer = IdempotencyLayer::new(store)
        .store_timeout(Duration::from_millis(200))
        .lease_duration(Duration::from_secs(10));
    let shutdown = layer.shutdown_handle();
    let (router, counter) = app(layer);
    let held = post_with_headers("k", &[("x-held", "1")]);
    let first = in_flight(&router, held, &counter).await;
    proxy.stall(true);
    counter.let_go(1);
    // The database cannot be reached when the handler finishes: the client is answered
    // all the same, and the key is still running in the table.
    let first = first.await.unwrap();
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

/// A handler that waits for the test to let it finish, then answers with `name`.
fn gated_app(
    layer: IdempotencyLayer,
    name: &'static str,
) -> (Router, Arc<tokio::sync::Semaphore>, common::Counter) {
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let counter = common::Counter::default();
    let (g, c) = (gate.clone(), counter.clone());
    let router = Router::new()
        .route(
            "/payments",
            post_route(move |State(()): State<()>| {
                let (g, c) = (g.clone(), c.clone());
                async move {
                    c.count_run();
                    let _permit = g.acquire().await.expect("gate");
                    (axum::http::StatusCode::CREATED, name)
                }
            }),
        )
        .layer(layer)
        .with_state(());
    (router, gate, counter)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_zombie_holder_is_fenced_and_the_stored_response_is_its_successors() {
    let schema = TestSchema::new();
    let proxy = PgProxy::start().await;
    let lease = Duration::from_millis(300);
    // Replica A reaches the database through the proxy; replica B directly.
    let layer_a = IdempotencyLayer::new(schema.store_at(&proxy.url(), 4).await)
        .lease_duration(lease)
        .store_timeout(Duration::from_millis(200));
    let layer_b = IdempotencyLayer::new(schema.store().await).lease_duration(lease);
    let shutdown_a = layer_a.shutdown_handle();
    let (router_a, gate_a, runs_a) = gated_app(layer_a, "from A");
    let (router_b, gate_b, runs_b) = gated_app(layer_b, "from B");
    gate_b.add_permits(1000);

    let zombie = in_flight(&router_a, post("k", "{}"), &runs_a).await;
    let (_, zombie_token) = row(&schema, "k").await.expect("A's claim");
    // A's renewals can no longer reach the database: its lease lapses while it runs.
    proxy.stall(true);
    let taken_over = retry_until_created(&router_b, "k", &[409]).await;
    assert_eq!(taken_over.outcome, Some(Outcome::Executed));
    assert_eq!(&taken_over.body[..], b"from B");
    let successor = Some(("completed".to_owned(), zombie_token + 1));
    assert_eq!(
        row(&schema, "k").await,
        successor,
        "taken over with the next token"
    );

    // The zombie wakes up, finishes, and tries to complete with its old token.
    proxy.stall(false);
    gate_a.add_permits(1);
    let zombie = zombie.await.unwrap();
    assert_eq!(zombie.status, 201);
    assert_eq!(
        &zombie.body[..],
        b"from A",
        "the zombie's client gets its own response"
    );
    // Its completion attempt is over once nothing is in flight.
    eventually(|| shutdown_a.in_flight() == 0).await;

    // The stored response is still B's, for every later retry, on either replica.
    for router in [&router_a, &router_b] {
        let replay = send(router, post("k", "{}")).await;
        assert_eq!(replay.outcome, Some(Outcome::Replayed));
        assert_eq!(&replay.body[..], b"from B");
    }
    assert_eq!(row(&schema, "k").await, successor);
    assert_eq!(
        (runs_a.runs(), runs_b.runs()),
        (1, 1),
        "once per lease epoch"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_client_that_hangs_up_does_not_cancel_the_handler() {
    let schema = TestSchema::new();
    let (router, counter) = app(IdempotencyLayer::new(schema.store().await));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(async move { axum::serve(listener, router).await });

    let hang_up = |key: Option<&str>| {
        let key_line = key
            .map(|k| format!("idempotency-key: {k}\r\n"))
            .unwrap_or_default();
        format!(
            "POST /payments HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\n\
             x-delay-ms: 400\r\n{key_line}content-length: 2\r\n\r\n{{}}"
        )
    };
    // Control: without a key the handler is the server's own future, and hanging up
    // cancels it half-way.
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    conn.write_all(hang_up(None).as_bytes()).await.unwrap();
    eventually(|| counter.runs() == 1).await;
    drop(conn);
    // With a key, the handler runs in its own task and finishes.
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    conn.write_all(hang_up(Some("k")).as_bytes()).await.unwrap();
    eventually(|| counter.runs() == 2).await;
    drop(conn);
    eventually(|| counter.finished() >= 1).await;
    wait_for_state(&schema, "k", "completed").await;
    assert_eq!(
        counter.finished(),
        1,
        "the unguarded handler was cancelled, the guarded one finished"
    );

    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<http_body_util::Full<axum::body::Bytes>>();
    let retry = axum::http::Request::post(format!("http://{addr}/payments"))
        .header("idempotency-key", "k")
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(axum::body::Bytes::from_static(
            b"{}",
        )))
        .unwrap();
    let res = client.request(retry).await.unwrap();
    assert_eq!(res.status(), 201);
    assert_eq!(res.headers()["idempotent-replayed"], "true");
    assert_eq!(counter.runs_of("k"), 1);
    server.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_client_that_hangs_up_during_its_claim_is_still_served_once() {
    let schema = TestSchema::new();
    let proxy = PgProxy::start().await;
    let store = schema.store_at(&proxy.url(), 2).await;
    // A long lease: a claim left behind by the hang-up would answer 409 for a minute.
    let layer = IdempotencyLayer::new(store.clone()).lease_duration(Duration::from_secs(60));
    let (router, counter) = app(layer);
    // Warm: the claim statement is prepared, so the stalled claim is on the wire whole.
    assert_eq!(send(&router, post("warm-up", "{}")).await.status, 201);
    proxy.stall(true);
    let before = store.statements_executed();
    let client = tokio::spawn({
        let router = router.clone();
        async move { send(&router, post("k", "{}")).await }
    });
    // Once the claim is sent (and held at the proxy), hang up.
    eventually(|| store.statements_executed() > before).await;
    client.abort();
    assert_eq!(counter.runs_of("k"), 0);
    proxy.stall(false);
    // The claim lands, the request runs without its client, and the retry replays it.
    wait_for_state(&schema, "k", "completed").await;
    let retry = send(&router, post("k", "{}")).await;
    assert_eq!(retry.outcome, Some(Outcome::Replayed));
    assert_eq!(counter.runs_of("k"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn graceful_shutdown_refuses_new_claims_and_waits_for_running_ones() {
    let schema = TestSchema::new();
    let store = schema.store().await;
    let layer = IdempotencyLayer::new(store.clone());
    let shutdown = layer.shutdown_handle();
    let (router, counter) = app(layer);
    assert_eq!(send(&router, post("done", "{}")).await.status, 201);
    let held = post_with_headers("running", &[("x-held", "1")]);
    let running = in_flight(&router, held, &counter).await;

    let drained = tokio::spawn({
        let shutdown = shutdown.clone();
        async move { shutdown.drain().await }
    });
    eventually(|| shutdown.is_closed()).await;
    let refused = send(&router, post("new", "{}")).await;
    assert_eq!(refused.status, 503);
    assert_eq!(refused.problem(), "shutting-down");
    assert!(refused.header("retry-after").is_some());
    // Replays too: the retry goes to a live instance, which replays it there.
    let replay = send(&router, post("done", "{}")).await;
    assert_eq!(replay.status, 503);
    assert_eq!(replay.problem(), "shutting-down");
    // Requests that pass through are not the layer's to refuse.
    assert_eq!(
        send(&router, req("POST").body(Body::from("{}")).unwrap())
            .await
            .status,
        201
    );
    assert!(
        !drained.is_finished(),
        "the drain did not wait for the running request"
    );
    counter.let_go(1);
    drained.await.unwrap();
    // Drained means stored: the running request's row is complete.
    assert_eq!(
        row(&schema, "running").await.map(|r| r.0).as_deref(),
        Some("completed")
    );
    assert_eq!(
        row(&schema, "new").await,
        None,
        "a refused request claims nothing"
    );
    assert_eq!(running.await.unwrap().status, 201);
    // Another instance on the same table replays it.
    let (other, other_counter) = app(IdempotencyLayer::new(store));
    assert_eq!(
        send(&other, post("running", "{}")).await.outcome,
        Some(Outcome::Replayed)
    );
    assert_eq!(other_counter.runs(), 0);
}

/// Renewals, completions and releases of running claims do not queue behind the app's
/// checkouts: with every connection of a replica's pool held by other work (long
/// handlers, transactional ones, the app's own queries) while two of its handlers run
/// for several leases, their leases hold, so retries on another replica get 409; then
/// one's response is stored and the other's key released, so the retries replay and
/// run, each key's handler once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pool_held_by_other_work_does_not_starve_running_claims() {
    let schema = TestSchema::new();
    // Renewed every 100 ms.
    let lease = Duration::from_millis(300);
    let store_a = schema.store_at(&common::database_url(), 4).await;
    let (router_a, runs_a) = app(IdempotencyLayer::new(store_a.clone()).lease_duration(lease));
    let (router_b, runs_b) = app(IdempotencyLayer::new(schema.store().await).lease_duration(lease));
    let stored = in_flight(
        &router_a,
        post_with_headers("k", &[("x-held", "1")]),
        &runs_a,
    )
    .await;
    let failing = post_with_headers("k2", &[("x-held", "1"), ("x-status", "503")]);
    let released = in_flight(&router_a, failing, &runs_a).await;
    // Other work takes every connection of A's pool, and holds them.
    let mut held = Vec::new();
    for _ in 0..store_a.pool().status().max_size {
        held.push(store_a.pool().get().await.expect("a connection"));
    }
    assert_eq!(store_a.pool().status().available, 0);
    // Past three leases: had no renewal landed, both keys would be free to take over.
    tokio::time::sleep(3 * lease).await;
    for key in ["k", "k2"] {
        let retry = send(&router_b, post(key, "{}")).await;
        assert_eq!(
            (key, retry.status.as_u16()),
            (key, 409),
            "the retry took the key over"
        );
    }
    runs_a.let_go(2);
    let stored = stored.await.unwrap();
    assert_eq!(stored.status, 201);
    assert_eq!(released.await.unwrap().status, 503);
    // Stored and released over the held pool.
    let replay = send(&router_b, post("k", "{}")).await;
    assert_eq!(replay.outcome, Some(Outcome::Replayed));
    assert_eq!(replay.body, stored.body);
    let rerun = send(&router_b, post("k2", "{}")).await;
    assert_eq!(rerun.outcome, Some(Outcome::Executed));
    assert_eq!((runs_a.runs_of("k"), runs_a.runs_of("k2")), (1, 1));
    assert_eq!((runs_b.runs_of("k"), runs_b.runs_of("k2")), (0, 1));
    // Over connections the store keeps outside its pool.
    assert!(store_a.metrics().reserve_statements >= 2);
    drop(held);
}

/// A login role with no rights of its own (`NOINHERIT`), which the pool's connections
/// leave for `writer` in a `post_create` hook (`SET ROLE`), as a least-privilege setup
/// does: (writer, login), dropped when the test ends.
async fn roles_for_set_role(schema: &TestSchema) -> (common::TestRole, common::TestRole) {
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
    (writer, login)
}

/// What the pool's hook and the store's setup both run: `SET ROLE role`.
fn acting_as(
    role: &str,
) -> impl for<'c> Fn(&'c tokio_postgres::Client) -> BoxFuture<'c, Result<(), tokio_postgres::Error>>
+ Clone
+ Send
+ Sync
+ 'static {
    let sql: Arc<str> = format!("SET ROLE \"{role}\"").into();
    move |client| {
        let sql = sql.clone();
        Box::pin(async move { client.batch_execute(&sql).await })
    }
}

/// A store on a pool of two connections that log in as `login` and act as `writer`
/// (`acting_as`, in its `post_create` hook), waiting `wait` for a connection; given
/// the same setup for its own connections if `setup`. Straight to the database: the
/// roles are the test's own, and a session's role would not hold behind a
/// transaction pooler.
fn store_acting_as(
    schema: &TestSchema,
    login: &common::TestRole,
    writer: &common::TestRole,
    wait: Duration,
    setup: bool,
) -> PostgresStore {
    use deadpool_postgres::{Hook, HookError, Manager, Pool, Runtime};
    let config: tokio_postgres::Config = common::url_as(&login.name).parse().expect("url");
    let hook = acting_as(&writer.name);
    let pool = Pool::builder(Manager::new(config, tokio_postgres::NoTls))
        .max_size(2)
        .runtime(Runtime::Tokio1)
        .wait_timeout(Some(wait))
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
        .with_background_purge(None);
    if let Some(period) = common::generations() {
        store = store.with_generations(period);
    }
    if setup {
        store = store.with_session_setup(acting_as(&writer.name));
    }
    store
}

/// The pool's connections act as a role with rights the login role lacks, set in the
/// pool's `post_create` hook; the store is given the same setup for its own
/// (`with_session_setup`). With every pooled connection checked out, the running
/// claim's renewals and its completion go over the reserve, as that role: its lease
/// holds through several leases, so a retry on another replica gets 409 instead of
/// running the handler again; then its response is stored and replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pool_whose_hook_sets_the_role_keeps_its_leases_when_all_checked_out() {
    let schema = TestSchema::new();
    let other = schema.store().await;
    let (writer, login) = roles_for_set_role(&schema).await;
    let store = store_acting_as(&schema, &login, &writer, Duration::from_secs(5), true);
    // Renewed every 100 ms.
    let lease = Duration::from_millis(300);
    let (router, runs) = app(IdempotencyLayer::new(store.clone()).lease_duration(lease));
    let (other_router, other_runs) = app(IdempotencyLayer::new(other).lease_duration(lease));
    let running = in_flight(&router, post_with_headers("k", &[("x-held", "1")]), &runs).await;
    let mut held = Vec::new();
    for _ in 0..store.pool().status().max_size {
        held.push(store.pool().get().await.expect("a pooled connection"));
    }
    // Past three leases: had no renewal landed, the retry would take the key over.
    tokio::time::sleep(3 * lease).await;
    let retry = send(&other_router, post("k", "{}")).await;
    assert_eq!(retry.status, 409, "the retry took the key over");
    runs.let_go(1);
    let stored = running.await.unwrap();
    assert_eq!(stored.status, 201);
    let replay = send(&other_router, post("k", "{}")).await;
    assert_eq!(replay.outcome, Some(Outcome::Replayed));
    assert_eq!(replay.body, stored.body);
    assert_eq!((runs.runs_of("k"), other_runs.runs()), (1, 0));
    // Renewed and stored over the reserve, the pool held throughout.
    assert!(store.metrics().reserve_statements >= 2);
    assert_eq!(store.pool().status().available, 0);
    drop(held);
}

/// The same pool, its store not given the hook's setup: a reserve connection runs as
/// the login role, and would renew, fail for want of privilege, and let the lease run
/// out under a live handler. It is checked before it serves and refused: with the pool
/// held, the renewal fails at once as misconfigured, saying what to do, and nothing
/// runs on the reserve; once a pooled connection is free, renewals hold again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_reserve_connection_without_the_pools_role_is_refused_not_used() {
    use tower_idempotency::store::StoreErrorKind;
    let schema = TestSchema::new();
    schema.store().await;
    let (writer, login) = roles_for_set_role(&schema).await;
    let store = store_acting_as(&schema, &login, &writer, Duration::from_millis(200), false);
    let scope = Scope::new("s");
    let request = ClaimRequest {
        scope: &scope,
        key: "k",
        fingerprint: Fingerprint::new([1; 32]),
        lease: Duration::from_secs(30),
        ttl: Duration::from_secs(60),
    };
    let Claim::Acquired(lease) = store.claim(&request).await.expect("a claim") else {
        panic!("the key was not acquired");
    };
    let mut held = Vec::new();
    for _ in 0..store.pool().status().max_size {
        held.push(store.pool().get().await.expect("a pooled connection"));
    }
    for _ in 0..2 {
        let refused = store.renew(&lease, Duration::from_secs(30)).await;
        let e = refused.expect_err("renewed as the login role");
        assert_eq!(e.kind(), StoreErrorKind::Misconfigured, "{e}");
        assert!(e.to_string().contains("with_session_setup"), "{e}");
    }
    assert_eq!(store.metrics().reserve_statements, 0);
    drop(held);
    let renewed = store.renew(&lease, Duration::from_secs(30)).await;
    assert!(renewed.expect("a renewal").is_kept());
}

/// Batched claims and shared claim connections both asked for: claims go in batches.
/// A claim held up on its way (a stalled network) past its caller's store timeout and
/// the store's wait for abandoned claims lands after that wait is over: it is released
/// by its token once it has, so the retry runs, instead of meeting 409 for the claim's
/// whole lease, as when such a claim went to a shared connection and was waited for
/// only as long as a batched one.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_batching_and_shared_claim_connections_a_claim_that_lands_late_is_released() {
    let schema = TestSchema::new();
    let proxy = PgProxy::start().await;
    let store = schema
        .store_at(&proxy.url(), 4)
        .await
        .with_shared_claim_connections(2)
        .with_batched_claims(1, 64);
    let layer = IdempotencyLayer::new(store.clone())
        .store_timeout(Duration::from_millis(300))
        .lease_duration(Duration::from_secs(600));
    let requests = layer.shutdown_handle();
    let (router, counter) = app(layer);
    // The claim statement prepared on the connection the claim below takes, so that
    // it goes out whole, in one write.
    assert_eq!(send(&router, post("warm", "{}")).await.status, 201);
    proxy.stall(true);
    assert_eq!(send(&router, post("k", "{}")).await.status, 503);
    // No new connection from here until the claim has landed: no cancel request
    // stops it on the way, and nothing releases it before it is seen to land.
    proxy.refuse(true);
    // The store stops waiting for the claim it gave up on (nothing of the request is
    // in flight then); only then does the claim go through, and land.
    eventually(|| requests.in_flight() == 0).await;
    proxy.stall(false);
    wait_for_state(&schema, "k", "running").await;
    proxy.refuse(false);
    let created = retry_until_created(&router, "k", &[409]).await;
    assert_eq!(created.status, 201);
    assert_eq!(counter.runs_of("k"), 1);
    let metrics = store.metrics();
    assert_eq!(metrics.shared_claims, 0);
    assert!(metrics.batched_claims >= 2, "{metrics:?}");
}

#[tokio::test]
async fn an_exhausted_pool_is_a_bounded_503_not_a_hang() {
    let schema = TestSchema::new();
    let store = schema.store_at(&common::database_url(), 1).await;
    let layer = IdempotencyLayer::new(store.clone()).store_timeout(Duration::from_millis(300));
    let (router, counter) = app(layer);
    // The pool's only connection is taken for the whole request.
    let held = store.pool().get().await.unwrap();
    let r = common::send_bounded(&router, post("k", "{}")).await;
    assert_eq!(r.status, 503);
    assert_eq!(r.problem(), "store-unavailable");
    assert_eq!(counter.runs(), 0);
    drop(held);
    // The claim answered 503 was still waiting for the connection; it lands now and is
    // released at once, so a retry may briefly see it (409), or wait for the one
    // connection past its own bound (503, which changes nothing), and then runs, once.
    retry_until_created(&router, "k", &[409, 503]).await;
    assert_eq!(counter.runs(), 1);
}

#[tokio::test]
async fn a_job_claim_that_lands_after_its_timeout_is_released_not_left_blocking() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tower_idempotency::{
        Scope,
        job::{JobError, JobOutcome, JobRunner},
    };
    let schema = TestSchema::new();
    let proxy = PgProxy::start().await;
    let store = schema.store_at(&proxy.url(), 1).await;
    // A long lease: if a late claim were left in place, redeliveries would find the job
    // running for a minute.
    let runner = JobRunner::new(store).lease_duration(Duration::from_secs(60));
    let impatient = runner.clone().store_timeout(Duration::from_millis(200));
    let scope = Scope::new("consumer");
    let runs = Arc::new(AtomicUsize::new(0));
    let deliver = |runner: &JobRunner, key: &'static str| {
        let (runner, scope, runs) = (runner.clone(), scope.clone(), runs.clone());
        async move {
            runner
                .run(&scope, key, b"{}", move |_| async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    Ok::<_, std::io::Error>(bytes::Bytes::from_static(b"done"))
                })
                .await
        }
    };
    // Redeliveries may briefly find the late claim running; it is released, and the
    // work then runs, once.
    let redeliver_until_it_runs = |key: &'static str| {
        let deliver = &deliver;
        let runner = &runner;
        async move {
            for attempt in 0.. {
                match deliver(runner, key).await {
                    Ok(JobOutcome::Ran(_)) => break,
                    Ok(JobOutcome::Running { .. }) if attempt < 100 => {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                    other => panic!("{key}, attempt {attempt}: {other:?}"),
                }
            }
        }
    };
    // Warm: the claim statement is prepared, so a stalled claim is on the wire whole.
    assert!(matches!(
        deliver(&runner, "warm-up").await,
        Ok(JobOutcome::Ran(_))
    ));

    // The runner's own bound.
    proxy.stall(true);
    let timed_out = deliver(&impatient, "k").await;
    assert!(
        matches!(timed_out, Err(JobError::Store(_))),
        "{timed_out:?}"
    );
    proxy.stall(false);
    redeliver_until_it_runs("k").await;

    // The caller's: the run is dropped while its claim is on the wire.
    proxy.stall(true);
    let dropped = tokio::time::timeout(Duration::from_millis(200), deliver(&runner, "k2")).await;
    assert!(dropped.is_err(), "the run ended while the database stalled");
    proxy.stall(false);
    redeliver_until_it_runs("k2").await;

    assert_eq!(
        runs.load(Ordering::SeqCst),
        3,
        "the warm-up, k and k2, once each"
    );
}

#[tokio::test]
async fn a_claim_that_lands_after_its_503_is_released_not_left_blocking() {
    let schema = TestSchema::new();
    let proxy = PgProxy::start().await;
    let store = schema.store_at(&proxy.url(), 1).await;
    // A long lease: if the late claim were left in place, retries would get 409 for
    // a minute.
    let layer = IdempotencyLayer::new(store)
        .store_timeout(Duration::from_millis(200))
        .lease_duration(Duration::from_secs(60));
    let (router, counter) = app(layer);
    // Warm: the claim statement is prepared, so a stalled claim is on the wire whole.
    assert_eq!(send(&router, post("warm-up", "{}")).await.status, 201);
    proxy.stall(true);
    let r = send(&router, post("k", "{}")).await;
    assert_eq!(r.status, 503);
    assert_eq!(counter.runs_of("k"), 0);
    proxy.stall(false);
    // A retry may briefly find the late claim (409), or wait for the one connection past
    // its own bound (503, which changes nothing); then it runs, once.
    retry_until_created(&router, "k", &[409, 503]).await;
    assert_eq!(counter.runs_of("k"), 1);
}

/// A URL that names a primary and its standby: the first stops answering (its machine
/// frozen, or cut off by the network: what its connections are sent, and new
/// connections to it, get no answer, and nothing fails), while the second serves. The
/// store passes over the first for the second, without a restart: 503 for the requests
/// on connections to the silent host, then served. It tried the hosts in the URL's
/// order, each until it answered, and so answered 503 for as long as the first stayed
/// silent.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_host_that_stops_answering_is_passed_over_for_the_next_in_the_url() {
    let schema = TestSchema::new();
    let proxy = PgProxy::start().await;
    let url = proxy.url_then_the_database();
    let store = PostgresStore::connect(&url)
        .expect("a store")
        .with_schema_name(&schema.name)
        .expect("schema name")
        .with_background_purge(None);
    store.migrate().await.expect("migrate");
    let layer = IdempotencyLayer::new(store.clone()).store_timeout(Duration::from_millis(300));
    let (router, counter) = app(layer);
    assert_eq!(send(&router, post("before", "{}")).await.status, 201);
    assert!(proxy.executes() > 0, "the first host did not serve");

    proxy.stall(true);
    let mut answers = Vec::new();
    loop {
        let r = common::send_bounded(&router, post("after", "{}")).await;
        answers.push(r.status.as_u16());
        if r.status == 201 {
            break;
        }
        assert_eq!(r.status, 503, "{answers:?}");
        assert_eq!(r.problem(), "store-unavailable");
        assert!(
            answers.len() < 10,
            "the store keeps to the silent host: {answers:?}"
        );
    }
    assert_eq!(counter.runs_of("after"), 1);
    let replay = send(&router, post("after", "{}")).await;
    assert_eq!(replay.outcome, Some(Outcome::Replayed));

    // A listener that connects while the first host is silent listens on the second.
    let other = PostgresStore::connect(&url)
        .expect("a store")
        .with_schema_name(&schema.name)
        .expect("schema name")
        .with_background_purge(None);
    other
        .listen()
        .await
        .expect("the listener keeps to the silent host");
    proxy.stall(false);
}

/// A `LISTEN` connection that goes silent (a NAT's idle timeout, a failover) is found out
/// by the listener's heartbeat, which keeps checking while no notification comes:
/// waiters then look again on their own and replay, not when the running request's
/// lease lapses.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn waiters_still_replay_when_the_listen_connection_goes_silent() {
    let schema = TestSchema::new();
    let proxy = PgProxy::start().await;
    let store = listening_through(&schema, &proxy).await;
    let layer = IdempotencyLayer::new(store.clone())
        .lease_duration(Duration::from_secs(60))
        .wait_for_running(Duration::from_secs(600));
    let (router, counter) = app(layer);
    store.listen().await.expect("the listener connects");
    // Quiet for longer than a heartbeat: no notification wakes the listener, neither for
    // its first check nor, once that is answered, for the next.
    tokio::time::sleep(Duration::from_secs(12)).await;
    // Then the connection goes silent, as a dropped one would: nothing it is sent
    // arrives, and nothing fails. The next heartbeat finds that out (by 15 s from now).
    proxy.stall(true);
    // The waiter finds it running. Its notification is lost, and its lease is 60 s: a
    // waiter that only woke when it lapsed would be too late.
    replayed_without_a_notification(&router, &counter).await;
    proxy.stall(false);
}

/// A 2 s request on `k`, and its duplicate, which waits for it (the layer's
/// `wait_for_running`) with no notification to come: it replays well within its bound,
/// and the handler ran once.
async fn replayed_without_a_notification(router: &Router, counter: &common::Counter) {
    let first = in_flight(
        router,
        post_with_headers("k", &[("x-delay-ms", "2000")]),
        counter,
    )
    .await;
    let waited = tokio::time::timeout(Duration::from_secs(30), send(router, post("k", "{}")))
        .await
        .expect("the waiter still waits for a notification that cannot come");
    assert_eq!(waited.outcome, Some(Outcome::Replayed));
    assert_eq!(first.await.expect("the first request").status, 201);
    assert_eq!(counter.runs_of("k"), 1);
}

/// A migrated store on `schema` whose pool connects directly, and whose notifications
/// alone pass through `proxy`.
async fn listening_through(schema: &TestSchema, proxy: &PgProxy) -> PostgresStore {
    schema
        .store()
        .await
        .with_notifications(proxy.url().parse().expect("the proxy's URL"))
}

/// A `LISTEN` that fails (on a standby during a failover, say) is tried again on a new
/// connection, rather than leaving the listener connected but deaf, and every waiter on
/// the fallback timer, for the life of the process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_listen_is_tried_again() {
    let schema = TestSchema::new();
    let proxy = PgProxy::start().await;
    let store = listening_through(&schema, &proxy).await;
    proxy.break_listen(true);
    assert!(
        store.listen().await.is_err(),
        "LISTEN failed, yet it listens"
    );
    assert!(!store.is_listening());
    proxy.break_listen(false);
    // Tried again with a backoff of up to 5 s between attempts.
    for _ in 0..200 {
        if store.is_listening() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        store.is_listening(),
        "the listener never tried LISTEN again"
    );
}

/// A `LISTEN` connection that answers every statement yet is sent no notification
/// (its `LISTEN` landed elsewhere, as behind a transaction pooler) does not count as
/// listening: a waiter looks again on its timer, and replays as soon as the first
/// request is done, not when its lease lapses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listen_connection_that_hears_nothing_does_not_count_as_listening() {
    let schema = TestSchema::new();
    let proxy = PgProxy::start().await;
    let store = listening_through(&schema, &proxy).await;
    proxy.deafen_listen(true);
    assert!(
        store.listen().await.is_err(),
        "it hears nothing, yet it listens"
    );
    assert!(!store.is_listening());
    let layer = IdempotencyLayer::new(store.clone())
        .lease_duration(Duration::from_secs(60))
        .wait_for_running(Duration::from_secs(600));
    let (router, counter) = app(layer);
    replayed_without_a_notification(&router, &counter).await;
    let metrics = store.metrics();
    assert_eq!(metrics.notifications, 0, "{metrics:?}");
    assert!(metrics.timer_wakeups > 0, "{metrics:?}");
}

/// A completion whose answer was lost with its connection, after the statement had
/// committed: sent again, as the layer retries a completion that failed, it is told
/// its result is kept (its own token completed the key with it), not that its lease
/// was lost; a completion by any other token, or of another response, is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_completion_whose_answer_was_lost_is_kept_when_sent_again() {
    let schema = TestSchema::new();
    let proxy = PgProxy::start().await;
    let store = schema.store_at(&proxy.url(), 1).await;
    let scope = Scope::anonymous();
    let claim = |key: &'static str| {
        let store = store.clone();
        let scope = scope.clone();
        async move {
            let request = ClaimRequest {
                scope: &scope,
                key,
                fingerprint: Fingerprint::new([0; 32]),
                lease: Duration::from_secs(60),
                ttl: Duration::from_secs(60),
            };
            match store.claim(&request).await {
                Ok(Claim::Acquired(lease)) => lease,
                other => panic!("{key}: {other:?}"),
            }
        }
    };
    let stored = tower_idempotency::StoredResponse {
        status: http::StatusCode::CREATED,
        headers: http::HeaderMap::new(),
        body: bytes::Bytes::from_static(b"stored"),
    };
    let minute = Duration::from_secs(60);
    // Prepares the completion: what the server answers next is the completion itself.
    let warm_up = claim("warm-up").await;
    assert!(
        store
            .complete(&warm_up, &stored, minute)
            .await
            .unwrap()
            .is_kept()
    );
    let lease = claim("k").await;
    proxy.cut_at_next_reply();
    store
        .complete(&lease, &stored, minute)
        .await
        .expect_err("the answer was lost");
    assert_eq!(
        row(&schema, "k").await,
        Some(("completed".to_owned(), lease.token.get()))
    );

    let again = store.complete(&lease, &stored, minute).await.unwrap();
    assert!(again.is_kept(), "{again:?}");
    let other = tower_idempotency::store::Lease {
        token: lease.token.next(),
        ..lease.clone()
    };
    let refused = store.complete(&other, &stored, minute).await.unwrap();
    assert!(!refused.is_kept(), "{refused:?}");
    // Nor is another response by the same token: a completed record is never
    // overwritten, and the caller is not told its response was stored.
    let different = tower_idempotency::StoredResponse {
        body: bytes::Bytes::from_static(b"different"),
        ..stored.clone()
    };
    let refused = store.complete(&lease, &different, minute).await.unwrap();
    assert!(!refused.is_kept(), "{refused:?}");
    assert_eq!(
        row(&schema, "k").await,
        Some(("completed".to_owned(), lease.token.get()))
    );
}
