//! A table in generations (`PostgresStore::with_generations`), on a real PostgreSQL:
//! one row per key across generations while they rotate under concurrent duplicates,
//! in both modes; a generation dropped only once none of its rows is live; replays and
//! takeovers of rows in older generations.
#![allow(clippy::unwrap_used)] // unwrap in the tests themselves: a failure is the test failing

mod common;

use std::{sync::Arc, time::Duration};

use common::{TestSchema, database_url, send};
use tower_idempotency::{
    Fingerprint, IdempotencyLayer, Outcome, Scope, StoredResponse,
    store::{Claim, ClaimRequest, PostgresStore, Store, StoreErrorKind, pool_for_url},
};

/// A period so short that every rotation starts a generation.
const EVERY_TIME: Duration = Duration::from_millis(1);

/// A migrated store in generations of `period`, with no background purge (the tests
/// rotate by hand), on a pool of `size` connections to `url`.
/// Through the transaction-pooling PgBouncer instead, if `TI_POOLER_URL` names one (as
/// `TestSchema::store_at`).
async fn store_at(schema: &TestSchema, url: &str, size: usize) -> PostgresStore {
    let (pool_url, pooling) = match common::pooler_url() {
        Some(pooler) if url == database_url() => (pooler, true),
        _ => (url.to_owned(), false),
    };
    let store = PostgresStore::new(pool_for_url(&pool_url, size).expect("pool"))
        .with_transaction_pooling(pooling)
        .with_schema_name(&schema.name)
        .expect("schema name")
        .with_notifications(url.parse().expect("url"))
        .with_background_purge(None)
        .with_generations(EVERY_TIME);
    store.migrate().await.expect("migrate");
    store
}

async fn store(schema: &TestSchema) -> PostgresStore {
    store_at(schema, &database_url(), 16).await
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

/// The partitions attached to the table, by generation.
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

fn request<'a>(scope: &'a Scope, key: &'a str, lease: Duration, ttl: Duration) -> ClaimRequest<'a> {
    ClaimRequest {
        scope,
        key,
        fingerprint: Fingerprint::new([7; 32]),
        lease,
        ttl,
    }
}

fn response(body: &'static str) -> StoredResponse {
    StoredResponse {
        status: http::StatusCode::CREATED,
        headers: http::HeaderMap::new(),
        body: body.into(),
    }
}

/// Claims and completes `key` with `ttl`, and returns the stored body.
async fn completed(store: &PostgresStore, key: &str, ttl: Duration, body: &'static str) {
    let scope = Scope::anonymous();
    let req = request(&scope, key, Duration::from_secs(60), ttl);
    let Claim::Acquired(lease) = store.claim(&req).await.expect("claim") else {
        panic!("{key} is new");
    };
    assert!(
        store
            .complete(&lease, &response(body), ttl)
            .await
            .expect("complete")
            .is_kept()
    );
}

#[tokio::test]
async fn a_new_table_is_made_in_generations_and_keys_go_to_the_newest() {
    let schema = TestSchema::new();
    let store = store(&schema).await;
    // Migrating again is a no-op, from any replica.
    store.migrate().await.expect("migrate again");
    assert_eq!(partitions(&schema).await, ["idempotency_keys_g1"]);

    completed(&store, "first", Duration::from_secs(3600), "one").await;
    assert_eq!(generation_of(&schema, "first").await, 1);

    tokio::time::sleep(Duration::from_millis(5)).await;
    let rotation = store.rotate_generations().await.expect("rotate");
    assert_eq!(rotation.started, Some(2));
    assert!(rotation.dropped.is_empty(), "{rotation:?}");
    completed(&store, "second", Duration::from_secs(3600), "two").await;
    assert_eq!(generation_of(&schema, "second").await, 2);

    // A replay from the older generation, as from the newest.
    let scope = Scope::anonymous();
    for (key, body) in [("first", "one"), ("second", "two")] {
        let req = request(
            &scope,
            key,
            Duration::from_secs(60),
            Duration::from_secs(60),
        );
        match store.claim(&req).await.expect("claim") {
            Claim::Completed { response, .. } => assert_eq!(response.body, body),
            other => panic!("{key}: {other:?}"),
        }
    }
    assert_eq!(rows_of(&schema, "first").await, 1);
}

#[tokio::test]
async fn a_generation_goes_only_once_none_of_its_rows_is_live() {
    let schema = TestSchema::new();
    // Keys forgotten with their responses: an expired row is not live (the next test
    // keeps them).
    let store = store(&schema).await.remember_keys_for(Duration::ZERO);
    let scope = Scope::anonymous();
    let short = Duration::from_millis(20);

    // Generation 1: an expired record, and one that lives an hour.
    completed(&store, "gone", short, "x").await;
    completed(&store, "kept", Duration::from_secs(3600), "y").await;
    tokio::time::sleep(Duration::from_millis(5)).await;
    assert_eq!(store.rotate_generations().await.unwrap().started, Some(2));

    // Generation 2: a running claim whose TTL passes while its lease lives.
    let running = request(&scope, "running", Duration::from_secs(60), short);
    let Claim::Acquired(lease) = store.claim(&running).await.unwrap() else {
        panic!("new")
    };
    assert_eq!(generation_of(&schema, "running").await, 2);
    tokio::time::sleep(Duration::from_millis(5)).await;
    assert_eq!(store.rotate_generations().await.unwrap().started, Some(3));

    // Generation 3: expired records only.
    completed(&store, "brief", short, "z").await;
    assert_eq!(generation_of(&schema, "brief").await, 3);
    tokio::time::sleep(Duration::from_millis(50)).await;

    // Generation 4 starts; 3 is past, every row in it expired: it goes. 1 holds an
    // unexpired record, 2 a running claim past its TTL under a live lease.
    let rotation = store.rotate_generations().await.unwrap();
    assert_eq!(rotation.started, Some(4));
    assert_eq!(rotation.emptied, [3], "{rotation:?}");
    assert_eq!(rotation.dropped, [3], "{rotation:?}");
    assert_eq!(
        partitions(&schema).await,
        [
            "idempotency_keys_g1",
            "idempotency_keys_g2",
            "idempotency_keys_g4"
        ]
    );
    assert_eq!(rows_of(&schema, "brief").await, 0);
    assert_eq!(rows_of(&schema, "kept").await, 1);
    assert_eq!(rows_of(&schema, "running").await, 1);

    // The running claim still holds its key, and completes.
    let duplicate = request(&scope, "running", Duration::from_secs(60), short);
    assert!(matches!(
        store.claim(&duplicate).await.unwrap(),
        Claim::Running { .. }
    ));
    assert!(
        store
            .complete(&lease, &response("r"), short)
            .await
            .unwrap()
            .is_kept()
    );
    tokio::time::sleep(Duration::from_millis(50)).await;
    // Generation 5 starts; 2 goes, and so does 4, which never held a row.
    let rotation = store.rotate_generations().await.unwrap();
    assert_eq!(rotation.started, Some(5));
    assert_eq!(rotation.emptied, [2, 4], "{rotation:?}");
    assert_eq!(rotation.dropped, [2, 4]);
    assert_eq!(rows_of(&schema, "kept").await, 1, "generation 1 holds on");

    // A key whose generation went is new again, in the newest generation.
    let again = request(&scope, "brief", Duration::from_secs(60), short);
    assert!(matches!(
        store.claim(&again).await.unwrap(),
        Claim::Acquired(_)
    ));
    assert_eq!(generation_of(&schema, "brief").await, 5);
}

/// A remembered row lives and rotates like the rest: its generation is emptied only
/// once it is forgotten, and a rotation first drops the headers and body of the rows
/// whose response expired.
#[tokio::test]
async fn a_generation_with_remembered_rows_goes_only_once_they_are_forgotten() {
    let schema = TestSchema::new();
    let window = Duration::from_millis(1500);
    let store = store(&schema).await.remember_keys_for(window);
    let scope = Scope::anonymous();
    completed(&store, "late", Duration::from_millis(20), "secret").await;
    tokio::time::sleep(Duration::from_millis(50)).await;

    // Generation 2 starts; 1 holds a remembered row (not reduced until this round):
    // it stays, and the row keeps no response.
    let rotation = store.rotate_generations().await.unwrap();
    assert_eq!((rotation.started, rotation.emptied.len()), (Some(2), 0));
    let reduced = schema
        .query(&format!(
            "SELECT headers IS NULL AND body IS NULL, status FROM \"{}\".idempotency_keys WHERE key = 'late'",
            schema.name
        ))
        .await;
    assert!(reduced[0].get::<_, bool>(0), "headers and body dropped");
    assert_eq!(reduced[0].get::<_, i16>(1), 201);
    let late = request(
        &scope,
        "late",
        Duration::from_secs(60),
        Duration::from_secs(60),
    );
    assert!(matches!(
        store.claim(&late).await.unwrap(),
        Claim::Remembered { .. }
    ));
    tokio::time::sleep(Duration::from_millis(5)).await;
    let rotation = store.rotate_generations().await.unwrap();
    assert!(!rotation.emptied.contains(&1), "{rotation:?}");
    assert_eq!(rows_of(&schema, "late").await, 1);

    // Forgotten: its generation goes, and the key is new again.
    tokio::time::sleep(window).await;
    let rotation = store.rotate_generations().await.unwrap();
    assert!(rotation.emptied.contains(&1), "{rotation:?}");
    assert_eq!(rows_of(&schema, "late").await, 0);
    assert!(matches!(
        store.claim(&late).await.unwrap(),
        Claim::Acquired(_)
    ));
}

/// The rotation's form of the previous release (three arguments, no window) stays,
/// for its stores during a rolling upgrade, and still rotates.
#[tokio::test]
async fn the_previous_release_s_rotation_still_runs() {
    let schema = TestSchema::new();
    let _store = store(&schema).await;
    let rows = schema
        .query(&format!(
            "SELECT started FROM \"{}\".idempotency_keys_rotate(1, 7, 50)",
            schema.name
        ))
        .await;
    assert_eq!(rows[0].get::<_, Option<i64>>(0), Some(2));
}

#[tokio::test]
async fn a_lapsed_lease_in_an_older_generation_is_taken_over_and_fenced() {
    let schema = TestSchema::new();
    let store = store(&schema).await;
    let scope = Scope::anonymous();
    let req = request(
        &scope,
        "k",
        Duration::from_millis(50),
        Duration::from_secs(3600),
    );
    let Claim::Acquired(first) = store.claim(&req).await.unwrap() else {
        panic!("new")
    };
    for _ in 0..2 {
        tokio::time::sleep(Duration::from_millis(5)).await;
        store.rotate_generations().await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(100)).await;

    let Claim::Acquired(second) = store.claim(&req).await.unwrap() else {
        panic!("the lapsed lease is taken over")
    };
    assert_eq!(second.token.get(), first.token.get() + 1);
    assert_eq!(
        generation_of(&schema, "k").await,
        1,
        "it stays in its generation"
    );
    assert!(
        !store
            .complete(&first, &response("late"), Duration::from_secs(60))
            .await
            .unwrap()
            .is_kept(),
        "the old holder's completion is refused"
    );
    assert!(
        store
            .complete(&second, &response("taken"), Duration::from_secs(60))
            .await
            .unwrap()
            .is_kept()
    );
    match store.claim(&req).await.unwrap() {
        Claim::Completed { response, .. } => assert_eq!(response.body, "taken"),
        other => panic!("{other:?}"),
    }
    // A row taken over holds its generation while it lives (the empty ones since go).
    tokio::time::sleep(Duration::from_millis(5)).await;
    let rotation = store.rotate_generations().await.unwrap();
    assert!(!rotation.emptied.contains(&1), "{rotation:?}");
    assert_eq!(rows_of(&schema, "k").await, 1);
}

/// The race the key's lock is for: a transactional claim holds its key, uncommitted, in
/// one generation; the next generation starts; a duplicate, which cannot see the
/// uncommitted row and would insert the key into the new generation, waits for the
/// key's lock instead, then finds the committed record and replays it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_across_a_boundary_waits_for_the_key_and_replays() {
    let schema = TestSchema::new();
    let store = store(&schema).await;
    let layer =
        IdempotencyLayer::transactional(store.clone()).wait_for_running(Duration::from_secs(30));
    let (router, counter) = common::app(layer);
    let held = common::in_flight(
        &router,
        common::post_with_headers("k", &[("x-held", "1")]),
        &counter,
    )
    .await;
    tokio::time::sleep(Duration::from_millis(5)).await;
    assert_eq!(store.rotate_generations().await.unwrap().started, Some(2));
    let duplicate = {
        let router = router.clone();
        tokio::spawn(async move { send(&router, common::post("k", "{}")).await })
    };
    schema.wait_for_lock_waiters(1).await;
    counter.let_go(1);
    let first = held.await.unwrap();
    assert_eq!(first.status, 201);
    let duplicate = duplicate.await.unwrap();
    assert_eq!(duplicate.status, 201);
    assert_eq!(duplicate.outcome, Some(Outcome::Replayed));
    assert_eq!(duplicate.body, first.body);
    assert_eq!(counter.runs(), 1);
    assert_eq!(rows_of(&schema, "k").await, 1);
    assert_eq!(generation_of(&schema, "k").await, 1);
}

/// Not told to wait, the duplicate waits on the key's lock only as long as on a row (the
/// claim's short `lock_timeout`), and gets the same `409` (PostgreSQL's `55P03` either
/// way); once the first commits, a retry replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_not_told_to_wait_gets_409_from_the_key_s_lock() {
    let schema = TestSchema::new();
    let store = store(&schema).await;
    let (router, counter) = common::app(IdempotencyLayer::transactional(store.clone()));
    let held = common::in_flight(
        &router,
        common::post_with_headers("k", &[("x-held", "1")]),
        &counter,
    )
    .await;
    tokio::time::sleep(Duration::from_millis(5)).await;
    assert_eq!(store.rotate_generations().await.unwrap().started, Some(2));
    let duplicate = send(&router, common::post("k", "{}")).await;
    assert_eq!(duplicate.status, 409);
    assert_eq!(duplicate.problem(), "in-progress");
    counter.let_go(1);
    let first = held.await.unwrap();
    assert_eq!(first.status, 201);
    let retry = send(&router, common::post("k", "{}")).await;
    assert_eq!(retry.outcome, Some(Outcome::Replayed));
    assert_eq!(retry.body, first.body);
    assert_eq!(counter.runs(), 1);
    assert_eq!(rows_of(&schema, "k").await, 1);
}

/// Keeps rotating the generations of `schema`'s table, a new one at every turn, until
/// `stop` is set; returns how many it started.
fn rotating(
    store: PostgresStore,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> tokio::task::JoinHandle<usize> {
    tokio::spawn(async move {
        let mut started = 0;
        while !stop.load(std::sync::atomic::Ordering::SeqCst) {
            if let Ok(rotation) = store.rotate_generations().await {
                started += usize::from(rotation.started.is_some());
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        started
    })
}

/// 200 requests with one key at once, over three stores (pools) of `url`, in rounds of
/// a fresh key each, while the generations rotate under them: one run per key, its
/// response to the others (or 409), one row across the generations.
async fn duplicates_while_rotating(url: &str, transactional: bool) {
    let schema = TestSchema::new();
    let mut routers = Vec::new();
    for _ in 0..3 {
        let store = store_at(&schema, url, 8).await;
        let layer = if transactional {
            IdempotencyLayer::transactional(store)
        } else {
            IdempotencyLayer::new(store)
        };
        routers.push(common::app(layer));
    }
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let rotator = rotating(store_at(&schema, url, 2).await, stop.clone());
    for round in 0..5 {
        let key = format!("race-{round}");
        let barrier = Arc::new(tokio::sync::Barrier::new(200));
        let tasks: Vec<_> = (0..200)
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
        assert_eq!(
            bodies
                .iter()
                .filter(|(o, _)| *o == Some(Outcome::Executed))
                .count(),
            1
        );
        assert_eq!(rows_of(&schema, &key).await, 1);
    }
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let started = rotator.await.unwrap();
    assert!(started > 0, "no generation started under the races");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn duplicates_run_once_while_generations_rotate() {
    duplicates_while_rotating(&database_url(), false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn transactional_duplicates_run_once_while_generations_rotate() {
    duplicates_while_rotating(&database_url(), true).await;
}

/// Under repeatable read or serializable, the look for the key in every generation
/// reads the claim's snapshot, taken before it waited for the key's lock, and could miss
/// a key committed since into another generation: such claims are refused, not run.
#[tokio::test]
async fn claims_outside_read_committed_are_refused() {
    let schema = TestSchema::new();
    store(&schema).await;
    for isolation in ["repeatable%5C%20read", "serializable"] {
        let url = common::url_with_default_isolation(isolation);
        let store = store_at(&schema, &url, 2).await;
        let scope = Scope::anonymous();
        let req = request(
            &scope,
            "k",
            Duration::from_secs(60),
            Duration::from_secs(60),
        );
        let e = store.claim(&req).await.expect_err("refused");
        assert_eq!(e.kind(), StoreErrorKind::Misconfigured, "{isolation}: {e}");
        let (router, counter) = common::app(IdempotencyLayer::transactional(store));
        let r = send(&router, common::post("k", "{}")).await;
        assert_eq!(r.status, 503, "{isolation}");
        assert_eq!(counter.runs(), 0);
    }
    assert_eq!(rows_of(&schema, "k").await, 0);
}

/// A plain table cannot become a partitioned one in place: a store in generations
/// refuses it, and says so.
#[tokio::test]
async fn a_plain_table_is_refused() {
    let schema = TestSchema::new();
    schema.store().await;
    let store = PostgresStore::new(pool_for_url(&database_url(), 2).expect("pool"))
        .with_schema_name(&schema.name)
        .expect("schema name")
        .with_generations(EVERY_TIME);
    let e = store.migrate().await.expect_err("a plain table");
    assert_eq!(e.kind(), StoreErrorKind::Misconfigured, "{e}");
}

/// The insert of a completed record for a key without one (transactional mode, after
/// the handler's own ROLLBACK) goes through the key's lock too: once per key.
#[tokio::test]
async fn a_completed_record_is_inserted_once() {
    let schema = TestSchema::new();
    store(&schema).await;
    let insert = format!(
        "SELECT \"{}\".idempotency_keys_insert_completed('', 'k', '\\x00', 1, 60000, 201::smallint, '\\x', 'b')",
        schema.name
    );
    let first: bool = schema.query(&insert).await[0].get(0);
    let second: bool = schema.query(&insert).await[0].get(0);
    assert!(first && !second);
    assert_eq!(rows_of(&schema, "k").await, 1);
}

/// An app role that may only read and write: besides the table, it reads
/// `<table>_generations` (the insert of a new key looks up the newest). Rotating needs the
/// table's owner (it creates, attaches, empties and drops partitions): the app role's
/// rotation fails, and says so, and claims go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_app_role_claims_and_the_owner_rotates() {
    let schema = TestSchema::new();
    let owner = store(&schema).await;
    let role = common::TestRole::new().await;
    let (s, r) = (&schema.name, &role.name);
    role.run(&format!(
        "GRANT USAGE ON SCHEMA \"{s}\" TO \"{r}\";
         GRANT SELECT, INSERT, UPDATE, DELETE ON \"{s}\".idempotency_keys TO \"{r}\";
         GRANT SELECT ON \"{s}\".idempotency_keys_migrations, \"{s}\".idempotency_keys_generations TO \"{r}\";"
    ))
    .await;
    let app = PostgresStore::new(pool_for_url(&common::url_as(r), 4).expect("pool"))
        .with_schema_name(s)
        .expect("schema name")
        .with_background_purge(None)
        .with_generations(EVERY_TIME);
    app.migrate().await.expect("migrate as the app's role");
    let (router, counter) = common::app(IdempotencyLayer::new(app.clone()));
    assert_eq!(send(&router, common::post("k", "{}")).await.status, 201);
    tokio::time::sleep(Duration::from_millis(5)).await;
    assert!(app.rotate_generations().await.is_err(), "not the owner");
    assert_eq!(owner.rotate_generations().await.unwrap().started, Some(2));
    assert_eq!(send(&router, common::post("k2", "{}")).await.status, 201);
    let replay = send(&router, common::post("k", "{}")).await;
    assert_eq!(replay.outcome, Some(Outcome::Replayed));
    assert_eq!(counter.runs(), 2);
    assert_eq!(generation_of(&schema, "k2").await, 2);
}

/// The key's lock is the table's own: a key held in one schema's table, by a transaction
/// that stays open, holds up no claim of the same key in another schema's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_held_in_one_table_does_not_hold_up_another_tables() {
    let (a, b) = (TestSchema::new(), TestSchema::new());
    let (store_a, store_b) = (store(&a).await, store(&b).await);
    let (router, counter) = common::app(IdempotencyLayer::transactional(store_a));
    let held = common::in_flight(
        &router,
        common::post_with_headers("k", &[("x-held", "1")]),
        &counter,
    )
    .await;
    let scope = Scope::anonymous();
    let req = request(
        &scope,
        "k",
        Duration::from_secs(60),
        Duration::from_secs(60),
    );
    let claimed = tokio::time::timeout(Duration::from_secs(10), store_b.claim(&req)).await;
    assert!(
        matches!(claimed, Ok(Ok(Claim::Acquired(_)))),
        "the other table's claim waited: {claimed:?}"
    );
    counter.let_go(1);
    assert_eq!(held.await.unwrap().status, 201);
}

/// The recorded steps of a key whose generation is emptied whole (a `TRUNCATE`, which
/// fires no trigger) are forgotten with it: a fresh claim of the key starts with none;
/// a live key's steps stay.
#[tokio::test]
async fn steps_of_a_generation_emptied_are_forgotten() {
    let schema = TestSchema::new();
    let store = store(&schema).await;
    let scope = Scope::anonymous();
    let short = Duration::from_millis(20);
    let step = |name: &str| tower_idempotency::store::RecordedStep {
        n: 0,
        name: name.into(),
        result: "\"x\"".into(),
    };
    let lapsed = request(&scope, "lapsed", short, short);
    let Claim::Acquired(dead) = store.claim(&lapsed).await.unwrap() else {
        panic!("new")
    };
    assert!(
        store
            .record_step(&dead, &step("charge"))
            .await
            .unwrap()
            .is_kept()
    );
    tokio::time::sleep(Duration::from_millis(50)).await;
    let first = store.rotate_generations().await.unwrap();
    assert_eq!(first.started, Some(2));
    let live = request(
        &scope,
        "live",
        Duration::from_secs(60),
        Duration::from_secs(60),
    );
    let Claim::Acquired(holder) = store.claim(&live).await.unwrap() else {
        panic!("new")
    };
    assert!(
        store
            .record_step(&holder, &step("ship"))
            .await
            .unwrap()
            .is_kept()
    );
    tokio::time::sleep(Duration::from_millis(5)).await;
    let rotation = store.rotate_generations().await.unwrap();
    assert!(
        first.emptied.contains(&1) || rotation.emptied.contains(&1),
        "{first:?} {rotation:?}"
    );
    let names: Vec<String> = schema
        .query(&format!(
            "SELECT name FROM \"{}\".idempotency_keys_steps",
            schema.name
        ))
        .await
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(names, ["ship"]);
    let again = request(
        &scope,
        "lapsed",
        Duration::from_secs(60),
        Duration::from_secs(60),
    );
    let Claim::Acquired(fresh) = store.claim(&again).await.unwrap() else {
        panic!("the key is new again")
    };
    assert_eq!(store.steps(&fresh).await.unwrap(), Some(vec![]));
}
