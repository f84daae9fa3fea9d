//! Batched claims (`PostgresStore::with_batched_claims`) on the real PostgreSQL: every
//! claim in a batch gets the answer it would have had alone, whatever else is in the
//! batch, across processes, and when the batch's connection is cut.
//!
//! A batch is filled deterministically by holding the only connection of the store's
//! pool: the claims queue while the batching connection waits for it, and go together
//! when the test lets it go (`waiting_for_a_batch` says when they all wait).

mod common;

use std::{
    io::{BufRead, BufReader, Write},
    process::{Command, Stdio},
    time::Duration,
};

use bytes::Bytes;
use common::{
    TestSchema, app, database_url, eventually, pooler_url, post_with_headers, proxy::PgProxy, send,
};
use http::{HeaderMap, StatusCode};
use tower_idempotency::{
    Fingerprint, IdempotencyLayer, Scope, StoredResponse,
    store::{
        Claim, ClaimRequest, Fenced, Lease, PostgresStore, Store, StoreErrorKind, pool_for_url,
    },
};

const A: Fingerprint = Fingerprint::new([1; 32]);
const B: Fingerprint = Fingerprint::new([2; 32]);

fn request<'a>(
    scope: &'a Scope,
    key: &'a str,
    fingerprint: Fingerprint,
    lease: Duration,
    ttl: Duration,
) -> ClaimRequest<'a> {
    ClaimRequest {
        scope,
        key,
        fingerprint,
        lease,
        ttl,
    }
}

const MINUTE: Duration = Duration::from_secs(60);
const MS: Duration = Duration::from_millis(1);

async fn acquire(
    store: &PostgresStore,
    key: &str,
    fingerprint: Fingerprint,
    lease: Duration,
    ttl: Duration,
) -> Lease {
    let scope = Scope::anonymous();
    match store
        .claim(&request(&scope, key, fingerprint, lease, ttl))
        .await
    {
        Ok(Claim::Acquired(lease)) => lease,
        other => panic!("{key}: not acquired: {other:?}"),
    }
}

fn response(body: &'static str) -> StoredResponse {
    StoredResponse {
        status: StatusCode::CREATED,
        headers: HeaderMap::new(),
        body: Bytes::from_static(body.as_bytes()),
    }
}

/// Polls until `sql` (one boolean) holds in the test's schema.
async fn until(schema: &TestSchema, sql: &str) {
    for _ in 0..500 {
        let rows = schema
            .query(&sql.replace("{t}", &format!("\"{}\".idempotency_keys", schema.name)))
            .await;
        if rows
            .first()
            .is_some_and(|r| r.get::<_, Option<bool>>(0) == Some(true))
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("never held: {sql}");
}

/// Polls until no statement on the test's schema runs but the poll's own. Behind a
/// transaction pooler, which sends no cancel request, a statement given up on while it
/// waits on a lock lands once the lock is let go, and is released in doubt after: until
/// it has landed, its key has no row for a moment, which is not yet the end.
async fn until_no_statement_runs(schema: &TestSchema) {
    until(
        schema,
        &format!(
            "SELECT count(*) = 0 FROM pg_stat_activity
              WHERE state = 'active' AND pid <> pg_backend_pid() AND query LIKE '%{}%'",
            schema.name
        ),
    )
    .await;
}

/// A connection of its own, outside every pool under test, holding a transaction open
/// after `BEGIN` and `sql` (`{t}`: the test's table): what it locks stays locked until
/// the test sends `COMMIT` or `ROLLBACK`, or drops it.
async fn in_a_transaction(schema: &TestSchema, sql: &str) -> tokio_postgres::Client {
    let (client, conn) = tokio_postgres::connect(&database_url(), tokio_postgres::NoTls)
        .await
        .expect("connect");
    tokio::spawn(conn);
    let table = format!("\"{}\".idempotency_keys", schema.name);
    client
        .batch_execute(&format!("BEGIN; {}", sql.replace("{t}", &table)))
        .await
        .expect("the transaction's statements");
    client
}

/// `lease`'s completion with the response "stored", in a task of its own.
fn complete_in_a_task(
    store: &PostgresStore,
    lease: Lease,
) -> tokio::task::JoinHandle<Result<Fenced, tower_idempotency::store::StoreError>> {
    let store = store.clone();
    tokio::spawn(async move { store.complete(&lease, &response("stored"), MINUTE).await })
}

/// A batched store on a pool of one connection, which the test can hold.
async fn batched_store(schema: &TestSchema, url: &str) -> PostgresStore {
    schema
        .store_at(url, 1)
        .await
        .with_background_purge(None)
        .with_batched_claims(1, 64)
}

/// Claims each of `claims` (key, fingerprint) at once while the pool's only connection
/// is held, so that they queue, then lets it go: they go as one batch.
async fn in_one_batch(
    store: &PostgresStore,
    claims: &[(&'static str, Fingerprint)],
) -> Vec<Result<Claim, tower_idempotency::store::StoreError>> {
    let held = store.pool().get().await.expect("the pool's connection");
    let tasks: Vec<_> = claims
        .iter()
        .map(|&(key, fingerprint)| {
            let store = store.clone();
            tokio::spawn(async move {
                let scope = Scope::anonymous();
                store
                    .claim(&request(&scope, key, fingerprint, MINUTE, MINUTE))
                    .await
            })
        })
        .collect();
    eventually(|| store.waiting_for_a_batch() == claims.len()).await;
    drop(held);
    let mut answers = Vec::new();
    for task in tasks {
        answers.push(task.await.expect("the claim's task"));
    }
    answers
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_batch_mixing_every_kind_of_key_answers_each_claim_as_alone() {
    let schema = TestSchema::new();
    // Keys remembered for 2 s once their response expired: "expired" is forgotten by
    // the time of the batch, "remembered" is not.
    let store = batched_store(&schema, &database_url())
        .await
        .remember_keys_for(Duration::from_secs(2));
    let done = acquire(&store, "done", A, MINUTE, MINUTE).await;
    assert!(
        store
            .complete(&done, &response("done"), MINUTE)
            .await
            .unwrap()
            .is_kept()
    );
    let running = acquire(&store, "running", A, MINUTE, MINUTE).await;
    let lapsed = acquire(&store, "lapsed", A, MS, MINUTE).await;
    let expired = acquire(&store, "expired", A, MINUTE, MS).await;
    assert!(
        store
            .complete(&expired, &response("expired"), MS)
            .await
            .unwrap()
            .is_kept()
    );
    until(
        &schema,
        "SELECT bool_and(locked_until <= now()) FROM {t} WHERE key = 'lapsed'",
    )
    .await;
    until(
        &schema,
        "SELECT bool_and(expires_at + interval '2 s' <= now()) FROM {t} WHERE key = 'expired'",
    )
    .await;
    let remembered = acquire(&store, "remembered", A, MINUTE, MS).await;
    assert!(
        store
            .complete(&remembered, &response("remembered"), MS)
            .await
            .unwrap()
            .is_kept()
    );
    until(
        &schema,
        "SELECT bool_and(expires_at <= now()) FROM {t} WHERE key = 'remembered'",
    )
    .await;

    let before = store.metrics();
    let claims = [
        ("new-1", A),
        ("twice", A),
        ("done", A),
        ("running", B),
        ("lapsed", A),
        ("new-2", B),
        ("twice", A),
        ("done", B),
        ("running", A),
        ("expired", B),
        ("remembered", B),
    ];
    let answers = in_one_batch(&store, &claims).await;
    let after = store.metrics();

    let replay = |answer: &Claim| match answer {
        Claim::Completed {
            fingerprint,
            response,
        } => (*fingerprint, response.body.clone()),
        other => panic!("not a replay: {other:?}"),
    };
    let holder = |answer: &Claim| match answer {
        Claim::Running { fingerprint, .. } => *fingerprint,
        other => panic!("not running: {other:?}"),
    };
    let token = |answer: &Claim| match answer {
        Claim::Acquired(lease) => lease.token,
        other => panic!("not acquired: {other:?}"),
    };
    let answers: Vec<Claim> = answers.into_iter().map(|a| a.expect("answered")).collect();
    // New keys: each acquired, with its own token.
    let (new_1, new_2) = (token(&answers[0]), token(&answers[5]));
    assert_ne!(new_1, new_2);
    // Two claims of one key in one batch: one runs, the other finds it running.
    match (&answers[1], &answers[6]) {
        (Claim::Acquired(_), Claim::Running { fingerprint, .. })
        | (Claim::Running { fingerprint, .. }, Claim::Acquired(_)) => assert_eq!(*fingerprint, A),
        other => panic!("twice: {other:?}"),
    }
    // A completed key replays, to the same request and to another (which the layer
    // answers 422: the fingerprints differ).
    assert_eq!(replay(&answers[2]), (A, Bytes::from_static(b"done")));
    assert_eq!(replay(&answers[7]), (A, Bytes::from_static(b"done")));
    // A running key: 409 for either request, with the holder's fingerprint.
    assert_eq!(holder(&answers[3]), A);
    assert_eq!(holder(&answers[8]), A);
    // A lapsed lease is taken over with the next token; so is an expired record, by
    // any request.
    assert_eq!(token(&answers[4]), lapsed.token.next());
    assert_eq!(token(&answers[9]), expired.token.next());
    // A remembered key (its response expired, the key not forgotten): refused, with
    // the fingerprint of the request that completed it.
    assert!(
        matches!(answers[10], Claim::Remembered { fingerprint, status, .. } if fingerprint == A && status == 201),
        "{:?}",
        answers[10]
    );

    // The rows say the same.
    let rows = schema
        .query(&format!(
            "SELECT key, state, token, fingerprint FROM \"{}\".idempotency_keys ORDER BY key",
            schema.name
        ))
        .await;
    let rows: Vec<(String, String, i64, Vec<u8>)> = rows
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
        .collect();
    let row = |key: &str| rows.iter().find(|r| r.0 == key).cloned().expect(key);
    assert_eq!(
        row("new-1"),
        (
            "new-1".into(),
            "running".into(),
            new_1.get(),
            A.as_bytes().to_vec()
        )
    );
    assert_eq!(
        row("new-2"),
        (
            "new-2".into(),
            "running".into(),
            new_2.get(),
            B.as_bytes().to_vec()
        )
    );
    assert_eq!(row("done").1, "completed");
    assert_eq!(
        row("running"),
        (
            "running".into(),
            "running".into(),
            running.token.get(),
            A.as_bytes().to_vec()
        )
    );
    assert_eq!(row("lapsed").2, lapsed.token.next().get());
    assert_eq!(
        row("expired"),
        (
            "expired".into(),
            "running".into(),
            expired.token.next().get(),
            B.as_bytes().to_vec()
        )
    );
    assert_eq!(row("remembered").1, "completed");
    assert_eq!(rows.len(), 8);

    // All eleven in one statement; the duplicate read again in a second.
    assert_eq!(after.claim_batches - before.claim_batches, 2);
    assert_eq!(after.batched_claims - before.batched_claims, 12);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_batch_whose_connection_is_cut_releases_each_claim_in_doubt() {
    let schema = TestSchema::new();
    let proxy = PgProxy::start().await;
    let store = batched_store(&schema, &proxy.url()).await;
    // Prepares the batch statement on the pool's connection: the next reply is the
    // batch's own.
    let done = acquire(&store, "done", A, MINUTE, MINUTE).await;
    assert!(
        store
            .complete(&done, &response("done"), MINUTE)
            .await
            .unwrap()
            .is_kept()
    );
    // Two replays in one batch: the batch statement is prepared too.
    for replay in in_one_batch(&store, &[("done", A), ("done", A)]).await {
        assert!(matches!(replay, Ok(Claim::Completed { .. })), "{replay:?}");
    }

    let keys = ["cut-1", "cut-2", "cut-3", "cut-4", "cut-5"];
    let mut claims: Vec<(&'static str, Fingerprint)> = keys.iter().map(|&k| (k, A)).collect();
    claims.push(("done", A));
    let held = store.pool().get().await.expect("the pool's connection");
    proxy.cut_at_next_reply();
    let before = proxy.executes();
    let tasks: Vec<_> = claims
        .iter()
        .map(|&(key, fingerprint)| {
            let store = store.clone();
            tokio::spawn(async move {
                let scope = Scope::anonymous();
                store
                    .claim(&request(&scope, key, fingerprint, MINUTE, MINUTE))
                    .await
            })
        })
        .collect();
    eventually(|| store.waiting_for_a_batch() == claims.len()).await;
    drop(held);
    // Each claim fails as it would alone: its connection was lost.
    for task in tasks {
        let answer = task.await.expect("the claim's task");
        assert_eq!(
            answer.expect_err("the connection was cut").kind(),
            StoreErrorKind::Unavailable
        );
    }
    assert!(proxy.executes() > before, "the batch was not sent");
    // The batch ran and committed; its answer was lost. Each new key's claim is
    // released in doubt, by its own token: none is left running for a lease.
    until(
        &schema,
        "SELECT count(*) = 0 FROM {t} WHERE key LIKE 'cut-%'",
    )
    .await;
    // And every key answers as before the cut.
    let answers = in_one_batch(&store, &claims).await;
    for (answer, (key, _)) in answers.into_iter().zip(&claims) {
        match (answer.expect("answered"), *key) {
            (Claim::Completed { .. }, "done") => {}
            (Claim::Acquired(_), key) if key != "done" => {}
            other => panic!("{key}: {other:?}"),
        }
    }
}

/// A batch whose callers all gave up before it was sent sends nothing; one whose
/// caller gave up while it was in flight releases that caller's insert.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn claims_given_up_on_leave_no_key_held() {
    let schema = TestSchema::new();
    let store = batched_store(&schema, &database_url()).await;
    let held = store.pool().get().await.expect("the pool's connection");
    let given_up = {
        let store = store.clone();
        tokio::spawn(async move {
            let scope = Scope::anonymous();
            store
                .claim(&request(&scope, "given-up", A, MINUTE, MINUTE))
                .await
        })
    };
    eventually(|| store.waiting_for_a_batch() == 1).await;
    given_up.abort();
    assert!(given_up.await.unwrap_err().is_cancelled());
    drop(held);
    // The next claim of the key is the first to land.
    let before = store.metrics();
    let lease = acquire(&store, "given-up", A, MINUTE, MINUTE).await;
    assert_eq!(store.metrics().batched_claims - before.batched_claims, 1);
    assert!(store.release(&lease).await.unwrap().is_kept());
}

/// A batch in flight whose callers all give up (the layer drops a claim it gave up on
/// at the store timeout, plus a few seconds) is abandoned: its statement cancelled, its
/// connection closed, and each of its claims released in doubt, so that no key is left
/// held for a lease by a claim nobody waits for.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_batch_whose_callers_all_gave_up_leaves_no_key_held() {
    let schema = TestSchema::new();
    let store = batched_store(&schema, &database_url()).await;
    // Warm: the pool's connection open, the statements prepared.
    for answer in in_one_batch(&store, &[("warm-1", A), ("warm-2", A)]).await {
        assert!(matches!(answer, Ok(Claim::Acquired(_))), "{answer:?}");
    }
    // Another transaction inserts `b-held` and holds it: a batch that inserts `a-free`
    // first, then `b-held`, waits there, `a-free` inserted and not committed.
    let (locker, conn) = tokio_postgres::connect(&database_url(), tokio_postgres::NoTls)
        .await
        .expect("connect");
    tokio::spawn(conn);
    locker
        .batch_execute(&format!(
            "BEGIN; INSERT INTO \"{}\".idempotency_keys (scope, key, fingerprint, state, token, locked_until, expires_at)
             VALUES ('', 'b-held', '\\x00', 'running', 1, now() + interval '1 minute', now() + interval '1 minute')",
            schema.name
        ))
        .await
        .expect("hold b-held");
    let held = store.pool().get().await.expect("the pool's connection");
    let claims: Vec<_> = ["a-free", "b-held"]
        .into_iter()
        .map(|key| {
            let store = store.clone();
            tokio::spawn(async move {
                let scope = Scope::anonymous();
                store.claim(&request(&scope, key, A, MINUTE, MINUTE)).await
            })
        })
        .collect();
    eventually(|| store.waiting_for_a_batch() == 2).await;
    drop(held);
    schema.wait_for_lock_waiters(1).await;
    // Both callers give up.
    for claim in claims {
        claim.abort();
        assert!(claim.await.unwrap_err().is_cancelled());
    }
    // The batch is cancelled on the server. (Behind a transaction pooler no cancel
    // request is sent: the statement goes on until the lock frees, lands, and is
    // released in doubt.)
    if pooler_url().is_none() {
        until(
            &schema,
            "SELECT count(*) = 0 FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%unnest%'",
        )
        .await;
    }
    // Either way nothing it did is left.
    locker
        .batch_execute("ROLLBACK")
        .await
        .expect("let b-held go");
    until_no_statement_runs(&schema).await;
    until(
        &schema,
        "SELECT count(*) = 0 FROM {t} WHERE key IN ('a-free', 'b-held')",
    )
    .await;
    for key in ["a-free", "b-held"] {
        acquire(&store, key, A, MINUTE, MINUTE).await;
    }
}

/// A stale token among the completions of one batch: that completion only is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stale_token_in_a_batch_of_completions_refuses_that_completion_only() {
    let schema = TestSchema::new();
    let store = batched_store(&schema, &database_url()).await;
    let keys = ["c-0", "c-1", "c-2", "c-3", "c-4"];
    let mut leases = Vec::new();
    for key in keys {
        leases.push(acquire(&store, key, A, MINUTE, MINUTE).await);
    }
    // A holder whose lapsed lease was taken over since: its token is stale.
    let stale = acquire(&store, "stale", A, MS, MINUTE).await;
    until(
        &schema,
        "SELECT bool_and(locked_until <= now()) FROM {t} WHERE key = 'stale'",
    )
    .await;
    let holder = acquire(&store, "stale", A, MINUTE, MINUTE).await;
    assert_eq!(holder.token, stale.token.next());

    // A completion held by a row lock is in flight; the others queue behind it.
    let locker = in_a_transaction(&schema, "SELECT 1 FROM {t} WHERE key = 'c-0' FOR UPDATE").await;
    let complete = |lease: Lease| complete_in_a_task(&store, lease);
    let held = complete(leases[0].clone());
    schema.wait_for_lock_waiters(1).await;
    let mut queued: Vec<_> = leases[1..].iter().cloned().map(&complete).collect();
    queued.insert(2, complete(stale.clone()));
    eventually(|| store.waiting_for_a_batch() == 5).await;
    locker.batch_execute("COMMIT").await.expect("let c-0 go");
    assert!(held.await.unwrap().unwrap().is_kept());
    let answers: Vec<bool> = futures_util::future::join_all(queued)
        .await
        .into_iter()
        .map(|done| done.unwrap().unwrap().is_kept())
        .collect();
    assert_eq!(answers, [true, true, false, true, true]);
    let rows = schema
        .query(&format!(
            "SELECT key, state, token FROM \"{}\".idempotency_keys ORDER BY key",
            schema.name
        ))
        .await;
    let rows: Vec<(String, String, i64)> = rows
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    for (key, lease) in keys.iter().zip(&leases) {
        assert!(
            rows.contains(&((*key).to_owned(), "completed".to_owned(), lease.token.get())),
            "{key}: {rows:?}"
        );
    }
    assert!(
        rows.contains(&("stale".to_owned(), "running".to_owned(), holder.token.get())),
        "{rows:?}"
    );
}

/// A batch of completions whose connection is cut while it runs: the statement goes on
/// and commits on the server, its answer never comes. Each completion in it fails as it
/// would alone (its connection was lost), and completed again, as the layer retries a
/// failed completion, each key ends completed by its own token with its own response.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_batch_of_completions_whose_connection_is_cut_fails_each_and_a_retry_stores_each() {
    let schema = TestSchema::new();
    let proxy = PgProxy::start().await;
    let store = batched_store(&schema, &proxy.url()).await;
    let keys = ["k-0", "k-1", "k-2", "k-3", "k-4"];
    let mut leases = Vec::new();
    for key in keys {
        leases.push(acquire(&store, key, A, MINUTE, MINUTE).await);
    }

    // k-0 and k-1 locked from outside the proxy: the lone completion of k-0 waits on
    // its lock, the others queue behind it; after `STALLED` they go as one batch on a
    // connection of their own, which waits on k-1's lock.
    let locker = in_a_transaction(
        &schema,
        "SELECT 1 FROM {t} WHERE key IN ('k-0', 'k-1') FOR UPDATE",
    )
    .await;
    let complete = |lease: Lease| complete_in_a_task(&store, lease);
    let lone = complete(leases[0].clone());
    schema.wait_for_lock_waiters(1).await;
    let batch: Vec<_> = leases[1..].iter().cloned().map(&complete).collect();
    eventually(|| store.waiting_for_a_batch() == 4).await;
    // The batch is sent once the lone completion has gone unanswered for a while.
    schema.wait_for_lock_waiters(2).await;
    assert_eq!(store.waiting_for_a_batch(), 0, "the batch was sent");

    // Every connection through the proxy is cut; the statements go on on the server,
    // and commit once the locks are let go.
    proxy.cut();
    for done in std::iter::once(lone).chain(batch) {
        let failed = done.await.expect("the completion's task");
        assert_eq!(
            failed.expect_err("the connection was cut").kind(),
            StoreErrorKind::Unavailable
        );
    }
    locker
        .batch_execute("COMMIT")
        .await
        .expect("let the keys go");
    // Until the cut statements have ended on the server: they committed there, or
    // failed as they went to answer.
    let running = format!(
        "SELECT count(*) = 0 FROM pg_stat_activity WHERE pid <> pg_backend_pid() \
         AND state = 'active' AND query LIKE '%{}%'",
        schema.name
    );
    until(&schema, &running).await;

    // Completed again, as the layer retries a completion that failed: a key the cut
    // statement completed is told its result is kept (nothing changes), one it did not
    // is completed now.
    for lease in &leases {
        let before: String = schema
            .query(&format!(
                "SELECT state FROM \"{}\".idempotency_keys WHERE key = '{}'",
                schema.name, lease.key
            ))
            .await[0]
            .get(0);
        let again = store
            .complete(lease, &response("stored"), MINUTE)
            .await
            .expect("the retry");
        assert!(again.is_kept(), "{}: {before}, then {again:?}", lease.key);
    }
    let rows = schema
        .query(&format!(
            "SELECT key, state, token, body FROM \"{}\".idempotency_keys ORDER BY key",
            schema.name
        ))
        .await;
    assert_eq!(rows.len(), keys.len());
    for (row, lease) in rows.iter().zip(&leases) {
        assert_eq!(row.get::<_, String>(0), &*lease.key);
        assert_eq!(row.get::<_, String>(1), "completed");
        assert_eq!(row.get::<_, i64>(2), lease.token.get());
        assert_eq!(row.get::<_, Vec<u8>>(3), b"stored");
    }
}

/// A batched store with pooled connections to spare: a lone claim is sent by its own
/// caller (it leads its idle slot), and what queues behind it has connections of its own.
async fn leading_store(schema: &TestSchema) -> PostgresStore {
    schema
        .store_at(&database_url(), 4)
        .await
        .with_background_purge(None)
        .with_batched_claims(1, 64)
}

/// Another transaction inserts `key` and holds it, uncommitted: a claim of the key reads
/// no row, and its insert waits on that transaction (a `FOR UPDATE` on a committed row
/// would not hold it: the claim only reads a key that exists).
async fn hold_uncommitted(schema: &TestSchema, key: &str) -> tokio_postgres::Client {
    in_a_transaction(
        schema,
        &format!(
            "INSERT INTO {{t}} (scope, key, fingerprint, state, token, locked_until, expires_at)
             VALUES ('', '{key}', '\\x00', 'running', 1, now() + interval '1 minute', now() + interval '1 minute')"
        ),
    )
    .await
}

fn claim_in_a_task(
    store: &PostgresStore,
    key: &'static str,
    fingerprint: Fingerprint,
) -> tokio::task::JoinHandle<Result<Claim, tower_idempotency::store::StoreError>> {
    let store = store.clone();
    tokio::spawn(async move {
        let scope = Scope::anonymous();
        store
            .claim(&request(&scope, key, fingerprint, MINUTE, MINUTE))
            .await
    })
}

/// A bound on a wait for an answer that must come (not a timing claim).
const ANSWERED_WITHIN: Duration = Duration::from_secs(30);

/// At light load each claim and completion is sent alone by its own caller, and gets
/// every answer it gets alone: its insert, a replay (to the same request and to
/// another), a 409, a takeover of a lapsed lease, a stale completion refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lone_claims_sent_by_their_callers_answer_as_alone() {
    let schema = TestSchema::new();
    let store = leading_store(&schema).await;
    let before = store.metrics();
    let done = acquire(&store, "done", A, MINUTE, MINUTE).await;
    assert!(
        store
            .complete(&done, &response("done"), MINUTE)
            .await
            .unwrap()
            .is_kept()
    );
    let running = acquire(&store, "running", A, MINUTE, MINUTE).await;
    let lapsed = acquire(&store, "lapsed", A, MS, MINUTE).await;
    until(
        &schema,
        "SELECT bool_and(locked_until <= now()) FROM {t} WHERE key = 'lapsed'",
    )
    .await;
    let scope = Scope::anonymous();
    let claim = |key: &'static str, fingerprint| {
        let store = store.clone();
        let scope = scope.clone();
        async move {
            store
                .claim(&request(&scope, key, fingerprint, MINUTE, MINUTE))
                .await
                .expect("answered")
        }
    };
    for fingerprint in [A, B] {
        match claim("done", fingerprint).await {
            Claim::Completed {
                fingerprint,
                response,
            } => assert_eq!(
                (fingerprint, response.body),
                (A, Bytes::from_static(b"done"))
            ),
            other => panic!("done: {other:?}"),
        }
        match claim("running", fingerprint).await {
            Claim::Running { fingerprint, .. } => assert_eq!(fingerprint, A),
            other => panic!("running: {other:?}"),
        }
    }
    let taken = match claim("lapsed", A).await {
        Claim::Acquired(lease) => lease,
        other => panic!("lapsed: {other:?}"),
    };
    assert_eq!(taken.token, lapsed.token.next());
    // The lapsed holder's completion is refused; the new holder's lands.
    assert!(
        !store
            .complete(&lapsed, &response("stale"), MINUTE)
            .await
            .unwrap()
            .is_kept()
    );
    assert!(
        store
            .complete(&taken, &response("taken"), MINUTE)
            .await
            .unwrap()
            .is_kept()
    );
    assert!(store.release(&running).await.unwrap().is_kept());
    // Each claim went alone (a batch of one), none queued.
    let after = store.metrics();
    assert_eq!(after.claim_batches - before.claim_batches, 8);
    assert_eq!(after.batched_claims - before.batched_claims, 8);
    assert_eq!(store.waiting_for_a_batch(), 0);
    let rows = schema
        .query(&format!(
            "SELECT key, state, token FROM \"{}\".idempotency_keys ORDER BY key",
            schema.name
        ))
        .await;
    let rows: Vec<(String, String, i64)> = rows
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    assert_eq!(
        rows,
        [
            ("done".into(), "completed".into(), done.token.get()),
            ("lapsed".into(), "completed".into(), taken.token.get()),
        ]
    );
}

/// A lone claim whose statement waits on a row lock does not hold the claims queued
/// behind it: past `STALLED` its caller hands the slot over, and they are sent while it
/// still waits; when the lock goes, it gets its own answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lone_claim_held_by_a_lock_lets_the_claims_behind_it_go() {
    let schema = TestSchema::new();
    let store = leading_store(&schema).await;
    acquire(&store, "warm", A, MINUTE, MINUTE).await;
    let locker = hold_uncommitted(&schema, "blocked").await;
    let blocked = claim_in_a_task(&store, "blocked", A);
    schema.wait_for_lock_waiters(1).await;
    // Queued behind the lone claim in flight.
    let behind = claim_in_a_task(&store, "behind", A);
    eventually(|| store.waiting_for_a_batch() == 1 || behind.is_finished()).await;
    let answer = tokio::time::timeout(ANSWERED_WITHIN, behind)
        .await
        .expect("the claim queued behind a held one was answered")
        .expect("the claim's task");
    assert!(
        matches!(answer, Ok(Claim::Acquired(_))),
        "behind: {answer:?}"
    );
    assert!(!blocked.is_finished(), "the lock still holds the first");
    assert_eq!(schema.lock_waiters().await, 1);
    // The lock goes (the other transaction rolls back): the key is free, and the
    // waiting claim inserts it, under its own token.
    locker
        .batch_execute("ROLLBACK")
        .await
        .expect("let blocked go");
    let lease = match tokio::time::timeout(ANSWERED_WITHIN, blocked)
        .await
        .expect("answered once the lock went")
        .expect("the claim's task")
    {
        Ok(Claim::Acquired(lease)) => lease,
        other => panic!("blocked: {other:?}"),
    };
    let rows = schema
        .query(&format!(
            "SELECT state, token FROM \"{}\".idempotency_keys WHERE key = 'blocked'",
            schema.name
        ))
        .await;
    assert_eq!(rows.len(), 1);
    assert_eq!(
        (rows[0].get::<_, String>(0), rows[0].get::<_, i64>(1)),
        ("running".into(), lease.token.get())
    );
    assert_eq!(store.waiting_for_a_batch(), 0);
}

/// A lone claim whose caller gives up while its statement waits on a lock leaves no key
/// held (its statement cancelled, what may have landed released in doubt), and hands
/// its slot over to the claim queued behind it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lone_claim_given_up_on_leaves_no_key_held_and_lets_the_queue_go() {
    let schema = TestSchema::new();
    let store = leading_store(&schema).await;
    acquire(&store, "warm", A, MINUTE, MINUTE).await;
    let locker = hold_uncommitted(&schema, "given-up").await;
    let given_up = claim_in_a_task(&store, "given-up", A);
    schema.wait_for_lock_waiters(1).await;
    let behind = claim_in_a_task(&store, "behind", A);
    eventually(|| store.waiting_for_a_batch() == 1 || behind.is_finished()).await;
    given_up.abort();
    assert!(given_up.await.unwrap_err().is_cancelled());
    let answer = tokio::time::timeout(ANSWERED_WITHIN, behind)
        .await
        .expect("the claim queued behind one given up on was answered")
        .expect("the claim's task");
    assert!(
        matches!(answer, Ok(Claim::Acquired(_))),
        "behind: {answer:?}"
    );
    // The statement is cancelled on the server. (Behind a transaction pooler no cancel
    // request is sent: it goes on until the lock frees, lands, and is released in doubt.)
    if pooler_url().is_none() {
        until(
            &schema,
            &format!(
                "SELECT count(*) = 0 FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%{}%'",
                schema.name
            ),
        )
        .await;
    }
    locker
        .batch_execute("ROLLBACK")
        .await
        .expect("let given-up go");
    until_no_statement_runs(&schema).await;
    // Nothing holds the key: no row, so no row claimed by the dropped caller's token
    // (behind a pooler, the one that landed is released in doubt).
    until(
        &schema,
        "SELECT count(*) = 0 FROM {t} WHERE key = 'given-up'",
    )
    .await;
    acquire(&store, "given-up", A, MINUTE, MINUTE).await;
    assert_eq!(store.waiting_for_a_batch(), 0);
}

/// The child of `duplicates_across_two_processes_run_once`: a hundred requests with one
/// key at once through the layer, when told to go; prints how many ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn child_sends_a_hundred_duplicates() {
    let Ok(schema) = std::env::var("TI_BATCH_CHILD_SCHEMA") else {
        return;
    };
    let url = database_url();
    let (pool_url, pooling) = match pooler_url() {
        Some(pooler) => (pooler, true),
        None => (url.clone(), false),
    };
    let store = PostgresStore::new(pool_for_url(&pool_url, 16).expect("pool"))
        .with_transaction_pooling(pooling)
        .with_schema_name(&schema)
        .expect("schema")
        .with_notifications(url.parse().expect("url"))
        .with_batched_claims(2, 64);
    let (router, counter) = app(IdempotencyLayer::new(store.clone()));
    // Connections open and statements prepared before the race.
    assert_eq!(
        send(
            &router,
            post_with_headers(&format!("warm-up-{}", std::process::id()), &[])
        )
        .await
        .status,
        201
    );
    // On a line of its own: the test harness may have begun one with the test's name.
    println!("\nready");
    let mut go = String::new();
    std::io::stdin().read_line(&mut go).expect("go");
    let tasks: Vec<_> = (0..100)
        .map(|_| {
            let router = router.clone();
            tokio::spawn(async move {
                send(
                    &router,
                    post_with_headers("one-key", &[("x-delay-ms", "100")]),
                )
                .await
                .status
            })
        })
        .collect();
    let mut statuses = std::collections::BTreeMap::new();
    for task in tasks {
        *statuses
            .entry(task.await.expect("request").as_u16())
            .or_insert(0) += 1;
    }
    let unexpected: Vec<_> = statuses
        .keys()
        .filter(|s| ![201, 409].contains(*s))
        .collect();
    println!(
        "\nruns={} unexpected={unexpected:?} statuses={statuses:?} (claims {} in {} batches)",
        counter.runs_of("one-key"),
        store.metrics().batched_claims,
        store.metrics().claim_batches,
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicates_across_two_processes_run_once() {
    let schema = TestSchema::new();
    schema.store().await;
    let exe = std::env::current_exe().expect("the test binary");
    let mut children: Vec<_> = (0..2)
        .map(|_| {
            Command::new(&exe)
                .args([
                    "--exact",
                    "child_sends_a_hundred_duplicates",
                    "--nocapture",
                    "--test-threads=1",
                ])
                .env("TI_BATCH_CHILD_SCHEMA", &schema.name)
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .expect("start a child")
        })
        .collect();
    let mut outputs: Vec<_> = children
        .iter_mut()
        .map(|c| BufReader::new(c.stdout.take().expect("stdout")).lines())
        .collect();
    for lines in &mut outputs {
        lines
            .by_ref()
            .map_while(Result::ok)
            .find(|l| l.ends_with("ready"))
            .expect("the child got ready");
    }
    for child in &mut children {
        writeln!(child.stdin.as_mut().expect("stdin"), "go").expect("go");
    }
    let mut runs = 0;
    for lines in &mut outputs {
        let line = lines
            .by_ref()
            .map_while(Result::ok)
            .find(|l| l.contains("runs="))
            .expect("the child's count");
        println!("{line}");
        assert!(line.contains("unexpected=[]"), "{line}");
        runs += line[line.find("runs=").expect("a count") + "runs=".len()..]
            .split(' ')
            .next()
            .and_then(|n| n.parse::<usize>().ok())
            .expect("a count");
    }
    for mut child in children {
        assert!(child.wait().expect("the child ends").success());
    }
    assert_eq!(
        runs, 1,
        "200 duplicates over two processes ran the key {runs} times"
    );
    let rows = schema
        .query(&format!(
            "SELECT state FROM \"{}\".idempotency_keys WHERE key = 'one-key'",
            schema.name
        ))
        .await;
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].get::<_, &str>(0), "completed");
}

/// A claim made before the upgrade to the JSON scheme (a bytes fingerprint) whose lease
/// lapsed is taken over through batched claims too: claimed again with the record's
/// fingerprint, it runs once, then is replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lapsed_claim_made_before_the_json_scheme_is_taken_over_through_a_batch() {
    use http::header::CONTENT_TYPE;
    use tower_idempotency::{FingerprintScheme, Outcome};
    let schema = TestSchema::new();
    let store = batched_store(&schema, &database_url()).await;
    let body = r#"{"amount":1000,"currency":"EUR"}"#;
    let (parts, _) = common::post("k", body).into_parts();
    let old = FingerprintScheme::Bytes.fingerprint(&parts, &[CONTENT_TYPE], body.as_bytes());
    let (scope, lease) = (Scope::anonymous(), Duration::from_secs(1));
    let request = ClaimRequest {
        scope: &scope,
        key: "k",
        fingerprint: old,
        lease,
        ttl: Duration::from_secs(60),
    };
    let Claim::Acquired(held) = store.claim(&request).await.unwrap() else {
        panic!("the old claim must acquire")
    };
    tokio::time::sleep(lease * 2).await;

    let (router, counter) = app(IdempotencyLayer::new(store.clone()));
    let retry = send(&router, common::post("k", body)).await;
    assert_eq!(retry.outcome, Some(Outcome::Executed), "{:?}", retry.body);
    let again = send(&router, common::post("k", body)).await;
    assert_eq!(again.outcome, Some(Outcome::Replayed));
    assert_eq!(counter.runs(), 1);
    let record = store.look_up(&scope, "k").await.unwrap().unwrap();
    assert_eq!(record.fingerprint, old);
    assert!(record.token > held.token);
}
