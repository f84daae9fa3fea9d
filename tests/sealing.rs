//! Stored responses sealed, keys hashed, headers removed, bodies left out: what the
//! table holds, and what a retry gets, on the memory store and PostgreSQL, in lease and
//! transactional mode, and for jobs.
#![allow(clippy::unwrap_used)] // unwrap in test helpers: a failure is the test failing

mod common;

use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use bytes::Bytes;
use common::{TestSchema, app, post, send};
use http::HeaderMap;
use tower_idempotency::{
    IdempotencyLayer, Outcome, Scope, StoredResponse,
    encryption::EncryptionKeys,
    job::{JobError, JobOutcome, JobRunner},
    store::{Claim, ClaimRequest, KeyState, MemoryStore, PostgresStore, Store, StoreErrorKind},
};

/// The card number every payment here echoes back in its body.
const CARD: &str = "4242424242424242";

fn keys() -> EncryptionKeys {
    EncryptionKeys::new(1, [0x11; 32])
}

fn body() -> String {
    format!("{{\"card\":\"{CARD}\"}}")
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Memory,
    Postgres,
    Transactional,
}

/// A store, and layers over it that share it (one per "deploy").
struct Setup {
    kind: Kind,
    store: Arc<dyn Store>,
    pg: Option<PostgresStore>,
    schema: Option<TestSchema>,
}

impl Setup {
    async fn new(kind: Kind) -> Self {
        if kind == Kind::Memory {
            return Self {
                kind,
                store: Arc::new(MemoryStore::new()),
                pg: None,
                schema: None,
            };
        }
        let schema = TestSchema::new();
        let pg = schema.store().await;
        Self {
            kind,
            store: Arc::new(pg.clone()),
            pg: Some(pg),
            schema: Some(schema),
        }
    }

    fn layer(&self) -> IdempotencyLayer {
        match self.kind {
            Kind::Transactional => IdempotencyLayer::transactional(self.pg.clone().unwrap()),
            _ => IdempotencyLayer::new(self.store.clone()),
        }
    }

    fn runner(&self) -> JobRunner {
        match self.kind {
            Kind::Transactional => JobRunner::transactional(self.pg.clone().unwrap()),
            _ => JobRunner::new(self.store.clone()),
        }
    }

    /// The response the store holds under `key` (as stored), as it holds it.
    async fn held(&self, scope: &Scope, key: &str) -> Option<StoredResponse> {
        let record = self.store.look_up(scope, key).await.unwrap()?;
        match record.state {
            KeyState::Completed { response } => Some(response),
            other => panic!("not completed: {other:?}"),
        }
    }

    fn table(&self) -> Option<String> {
        Some(format!(
            "\"{}\".idempotency_keys",
            self.schema.as_ref()?.name
        ))
    }

    /// Every row's columns as bytes, read straight from the table (PostgreSQL).
    async fn rows(&self) -> Vec<Vec<u8>> {
        let Some(table) = self.table() else {
            return Vec::new();
        };
        let rows = self
            .schema
            .as_ref()
            .unwrap()
            .query(&format!(
                "SELECT convert_to(scope || key, 'UTF8') || fingerprint || coalesce(headers, '') || coalesce(body, '') FROM {table}"
            ))
            .await;
        rows.iter().map(|r| r.get::<_, Vec<u8>>(0)).collect()
    }

    /// Copies the stored response of `from` onto the completed record of `to` (both
    /// as the client sends them), as someone with write access to the table would; on
    /// the memory store, onto `to` afresh (a key it does not hold yet).
    async fn move_response(&self, keys: &EncryptionKeys, from: &str, to: &str) {
        let anonymous = Scope::anonymous();
        let (from, to) = (keys.stored_key(from), keys.stored_key(to));
        if let Some(table) = self.table() {
            let moved = self
                .schema
                .as_ref()
                .unwrap()
                .query(&format!(
                    "UPDATE {table} AS t SET status = f.status, headers = f.headers, body = f.body
                     FROM {table} AS f WHERE t.key = '{to}' AND f.key = '{from}' RETURNING 1"
                ))
                .await;
            assert_eq!(moved.len(), 1);
            return;
        }
        // The memory store: `to` is written afresh through the store, with the
        // fingerprint `from` has (the same request body), holding `from`'s response.
        let record = self
            .store
            .look_up(&anonymous, &from)
            .await
            .unwrap()
            .unwrap();
        let KeyState::Completed { response } = record.state else {
            panic!("not completed")
        };
        let request = ClaimRequest {
            scope: &anonymous,
            key: &to,
            fingerprint: record.fingerprint,
            lease: Duration::from_secs(30),
            ttl: Duration::from_secs(3600),
        };
        let Claim::Acquired(lease) = self.store.claim(&request).await.unwrap() else {
            panic!("{to} is new")
        };
        let kept = self
            .store
            .complete(&lease, &response, request.ttl)
            .await
            .unwrap();
        assert!(kept.is_kept());
    }
}

/// Whether `haystack` holds `needle`.
fn holds(haystack: &[u8], needle: &str) -> bool {
    haystack
        .windows(needle.len())
        .any(|w| w == needle.as_bytes())
}

/// What the `fmt` subscriber prints while the guard lives, into a buffer.
fn logs() -> (Arc<Mutex<Vec<u8>>>, tracing::subscriber::DefaultGuard) {
    #[derive(Clone)]
    struct Writer(Arc<Mutex<Vec<u8>>>);
    impl std::io::Write for Writer {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let out = Arc::new(Mutex::new(Vec::new()));
    let writer = Writer(out.clone());
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .finish();
    (out, tracing::subscriber::set_default(subscriber))
}

macro_rules! on_every_store {
    ($($name:ident),* $(,)?) => {
        mod memory {
            $(#[tokio::test] async fn $name() { super::$name(super::Kind::Memory).await; })*
        }
        mod postgres {
            $(#[tokio::test] async fn $name() { super::$name(super::Kind::Postgres).await; })*
        }
        mod transactional {
            $(#[tokio::test] async fn $name() { super::$name(super::Kind::Transactional).await; })*
        }
    };
}

on_every_store!(
    a_sealed_record_holds_neither_body_nor_key_and_replays,
    a_response_moved_onto_another_key_is_refused_and_nothing_runs,
    records_sealed_under_an_old_key_replay_after_a_new_one_is_added,
    records_stored_before_encryption_still_replay,
    set_cookie_is_not_replayed_unless_the_app_keeps_it,
    without_bodies_a_replay_says_where_the_result_is,
    a_job_result_is_sealed_and_its_key_hashed,
    a_job_result_stored_before_encryption_is_still_done,
    records_from_before_principals_and_encryption_replay_under_both,
    records_from_before_the_json_scheme_replay_sealed_and_in_clear,
);

async fn a_sealed_record_holds_neither_body_nor_key_and_replays(kind: Kind) {
    let setup = Setup::new(kind).await;
    let keys = keys();
    let (router, counter) = app(setup.layer().encrypt_responses(keys.clone()));
    let key = "client-key-5f1c";
    let first = send(&router, post(key, &body())).await;
    assert_eq!(first.status, 201);
    assert!(holds(&first.body, CARD));
    let second = send(&router, post(key, &body())).await;
    assert_eq!(second.outcome, Some(Outcome::Replayed));
    assert_eq!(counter.runs(), 1);
    assert_eq!((second.status, &second.body), (first.status, &first.body));
    assert_eq!(second.header("location"), first.header("location"));
    assert_eq!(second.header("content-type"), Some("application/json"));

    // What the store holds: the status in clear, nothing else of the response, and
    // no record under the key itself.
    let anonymous = Scope::anonymous();
    assert!(
        setup
            .store
            .look_up(&anonymous, key)
            .await
            .unwrap()
            .is_none()
    );
    let held = setup.held(&anonymous, &keys.stored_key(key)).await.unwrap();
    assert_eq!(held.status, 201);
    assert_eq!(held.headers.len(), 1, "{:?}", held.headers);
    for secret in [CARD, key, "/payments/1", "application/json"] {
        assert!(!holds(&held.body, secret), "{secret} in the sealed body");
    }
    // Straight from the table: no column of any row holds the body or the key.
    let rows = setup.rows().await;
    assert_eq!(rows.len(), usize::from(kind != Kind::Memory));
    for row in rows {
        for secret in [CARD, key, "/payments/1", "echo"] {
            assert!(!holds(&row, secret), "{secret} in a row");
        }
    }
}

async fn a_response_moved_onto_another_key_is_refused_and_nothing_runs(kind: Kind) {
    let setup = Setup::new(kind).await;
    let keys = keys();
    let (router, counter) = app(setup.layer().encrypt_responses(keys.clone()));
    // One request body, so both keys hold the same fingerprint.
    assert_eq!(send(&router, post("first-key", &body())).await.status, 201);
    if setup.table().is_some() {
        assert_eq!(send(&router, post("second-key", &body())).await.status, 201);
    }
    setup.move_response(&keys, "first-key", "second-key").await;

    let (printed, guard) = logs();
    let moved = send(&router, post("second-key", &body())).await;
    drop(guard);
    assert_eq!(moved.status, 500);
    assert_eq!(moved.problem(), "response-unreadable");
    assert!(!holds(&moved.body, CARD));
    let ran = 1 + usize::from(setup.table().is_some());
    assert_eq!(counter.runs(), ran, "nothing runs again");
    let printed = String::from_utf8(printed.lock().unwrap().clone()).unwrap();
    assert!(printed.contains("ERROR"), "{printed}");
    assert!(printed.contains("could not be opened"), "{printed}");
    assert!(printed.contains("does not authenticate"), "{printed}");
    assert!(printed.contains("key_id=1"), "{printed}");
    assert!(
        !printed.contains("second-key"),
        "the key itself is logged: {printed}"
    );
    // The record it was copied from still replays.
    let first = send(&router, post("first-key", &body())).await;
    assert_eq!(first.outcome, Some(Outcome::Replayed));
}

async fn records_sealed_under_an_old_key_replay_after_a_new_one_is_added(kind: Kind) {
    let setup = Setup::new(kind).await;
    let old = keys();
    let (before, _) = app(setup.layer().encrypt_responses(old.clone()));
    let first = send(&before, post("rotated", &body())).await;
    assert_eq!(first.status, 201);

    let rotated = old.with_key(2, [0x22; 32]).unwrap();
    let (after, counter) = app(setup.layer().encrypt_responses(rotated.clone()));
    let replay = send(&after, post("rotated", &body())).await;
    assert_eq!(replay.outcome, Some(Outcome::Replayed));
    assert_eq!(replay.body, first.body);
    assert_eq!(counter.runs(), 0);

    // New records are sealed under the newest key; the key's hash did not change.
    assert_eq!(send(&after, post("new", &body())).await.status, 201);
    let anonymous = Scope::anonymous();
    let held_old = setup
        .held(&anonymous, &rotated.stored_key("rotated"))
        .await
        .unwrap();
    let held_new = setup
        .held(&anonymous, &rotated.stored_key("new"))
        .await
        .unwrap();
    assert_eq!(&held_old.body[1..5], &1u32.to_be_bytes());
    assert_eq!(&held_new.body[1..5], &2u32.to_be_bytes());
    // A layer whose keys no longer have id 1 (the same first key's bytes, so the same
    // hashes, under id 9) refuses its records rather than run them.
    let (dropped, counter) = app(setup.layer().encrypt_responses(
        EncryptionKeys::new(9, [0x11; 32])
            .with_key(2, [0x22; 32])
            .unwrap(),
    ));
    let refused = send(&dropped, post("rotated", &body())).await;
    assert_eq!(refused.problem(), "response-unreadable");
    assert_eq!(counter.runs(), 0);
}

async fn records_stored_before_encryption_still_replay(kind: Kind) {
    let setup = Setup::new(kind).await;
    let (before, _) = app(setup.layer());
    let first = send(&before, post("from-before", &body())).await;
    assert_eq!(first.status, 201);

    let keys = keys();
    let (after, counter) = app(setup.layer().encrypt_responses(keys.clone()));
    let replay = send(&after, post("from-before", &body())).await;
    assert_eq!(replay.outcome, Some(Outcome::Replayed));
    assert_eq!(replay.body, first.body);
    let other = send(&after, post("from-before", "{\"card\":\"other\"}")).await;
    assert_eq!(other.problem(), "key-reused");
    assert_eq!(counter.runs(), 0);
    // The claim under the key's hash was let go: the record from before answers.
    let anonymous = Scope::anonymous();
    assert!(
        setup
            .store
            .look_up(&anonymous, &keys.stored_key("from-before"))
            .await
            .unwrap()
            .is_none()
    );
    // A key new to both runs once, sealed.
    assert_eq!(send(&after, post("after", &body())).await.status, 201);
    assert_eq!(counter.runs(), 1);
}

/// Records made under the bytes scheme (before the JSON scheme), sealed, or in clear
/// from before encryption too, replay to their identical retries once the layer
/// compares JSON as JSON; the retry is compared the record's way.
async fn records_from_before_the_json_scheme_replay_sealed_and_in_clear(kind: Kind) {
    use tower_idempotency::FingerprintScheme;
    let setup = Setup::new(kind).await;
    let keys = keys();
    let bytes = |layer: IdempotencyLayer| layer.fingerprint_scheme(FingerprintScheme::Bytes);
    let (clear, _) = app(bytes(setup.layer()));
    let in_clear = send(&clear, post("in-clear", &body())).await;
    assert_eq!(in_clear.status, 201);
    let (sealed, _) = app(bytes(setup.layer()).encrypt_responses(keys.clone()));
    let was_sealed = send(&sealed, post("sealed", &body())).await;
    assert_eq!(was_sealed.status, 201);

    let (after, counter) = app(setup.layer().encrypt_responses(keys.clone()));
    for (key, first) in [("in-clear", &in_clear), ("sealed", &was_sealed)] {
        let replay = send(&after, post(key, &body())).await;
        assert_eq!(replay.outcome, Some(Outcome::Replayed), "{key}");
        assert_eq!(replay.body, first.body, "{key}");
        let other = send(&after, post(key, "{\"card\":\"other\"}")).await;
        assert_eq!(other.problem(), "key-reused", "{key}");
    }
    assert_eq!(counter.runs(), 0);
}

async fn set_cookie_is_not_replayed_unless_the_app_keeps_it(kind: Kind) {
    let setup = Setup::new(kind).await;
    let (default, _) = app(setup.layer().encrypt_responses(keys()));
    let first = send(&default, post("cookie-default", &body())).await;
    assert_eq!(first.header("set-cookie"), Some("session=1"));
    let replay = send(&default, post("cookie-default", &body())).await;
    assert_eq!(replay.outcome, Some(Outcome::Replayed));
    assert_eq!(replay.header("set-cookie"), None);
    assert!(replay.header("location").is_some());

    // The app's own rule: cookies kept, its own header removed.
    let layer = setup
        .layer()
        .encrypt_responses(keys())
        .unreplayed_headers_with(|headers: &mut HeaderMap| {
            headers.remove("x-run");
        });
    let (kept, _) = app(layer);
    let first = send(&kept, post("cookie-kept", &body())).await;
    let replay = send(&kept, post("cookie-kept", &body())).await;
    assert_eq!(replay.outcome, Some(Outcome::Replayed));
    assert_eq!(replay.header("set-cookie"), first.header("set-cookie"));
    assert_eq!(replay.header("x-run"), None);

    // The list works as before: it replaces the default too.
    let (listed, _) = app(setup.layer().unreplayed_headers([]));
    send(&listed, post("cookie-listed", &body())).await;
    let replay = send(&listed, post("cookie-listed", &body())).await;
    assert!(replay.header("set-cookie").is_some());
}

async fn without_bodies_a_replay_says_where_the_result_is(kind: Kind) {
    let setup = Setup::new(kind).await;
    let (router, counter) = app(setup
        .layer()
        .encrypt_responses(keys())
        .store_response_bodies(false));
    let first = send(&router, post("no-body", &body())).await;
    assert_eq!(first.status, 201);
    assert!(holds(&first.body, CARD), "the first client gets it all");
    let replay = send(&router, post("no-body", &body())).await;
    assert_eq!(replay.outcome, Some(Outcome::Replayed));
    assert_eq!(counter.runs(), 1);
    assert_eq!(replay.status, 201);
    assert!(replay.body.is_empty());
    assert_eq!(replay.header("location"), first.header("location"));
    assert_eq!(replay.header("content-type"), None);
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    // Without encryption too: the table holds no body.
    let (clear, _) = app(setup.layer().store_response_bodies(false));
    send(&clear, post("no-body-clear", &body())).await;
    let held = setup
        .held(&Scope::anonymous(), "no-body-clear")
        .await
        .unwrap();
    assert!(held.body.is_empty());
    assert_eq!(held.headers.get("content-type"), None);
    assert!(held.headers.get("location").is_some());
}

/// Runs `key` on `runner` with a work that counts its runs and returns `result`.
async fn run_job(
    runner: &JobRunner,
    key: &str,
    runs: &Arc<AtomicUsize>,
    result: &'static str,
) -> Result<JobOutcome, JobError<std::io::Error>> {
    let runs = runs.clone();
    runner
        .run(
            &Scope::new("consumer"),
            key,
            b"input",
            move |_ctx| async move {
                runs.fetch_add(1, Ordering::SeqCst);
                Ok::<_, std::io::Error>(Bytes::from_static(result.as_bytes()))
            },
        )
        .await
}

async fn a_job_result_is_sealed_and_its_key_hashed(kind: Kind) {
    let setup = Setup::new(kind).await;
    let keys = keys();
    let runner = setup.runner().encrypt_results(keys.clone());
    let runs = Arc::new(AtomicUsize::new(0));
    let secret = "result-9c2e-secret";
    let ran = run_job(&runner, "message-1", &runs, secret).await.unwrap();
    assert_eq!(ran, JobOutcome::Ran(Bytes::from_static(secret.as_bytes())));
    let again = run_job(&runner, "message-1", &runs, secret).await.unwrap();
    assert_eq!(
        again,
        JobOutcome::AlreadyDone(Bytes::from_static(secret.as_bytes()))
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    let scope = Scope::new("consumer");
    assert!(
        setup
            .store
            .look_up(&scope, "message-1")
            .await
            .unwrap()
            .is_none()
    );
    let held = setup
        .held(&scope, &keys.stored_key("message-1"))
        .await
        .unwrap();
    assert!(!holds(&held.body, secret));
    for row in setup.rows().await {
        assert!(!holds(&row, secret) && !holds(&row, "message-1"));
    }

    // A result moved onto another key is refused, and the work does not run.
    if setup.table().is_some() {
        run_job(&runner, "message-2", &runs, "other").await.unwrap();
        let table = setup.table().unwrap();
        let (from, to) = (keys.stored_key("message-1"), keys.stored_key("message-2"));
        setup
            .schema
            .as_ref()
            .unwrap()
            .query(&format!(
                "UPDATE {table} AS t SET body = f.body FROM {table} AS f
                 WHERE t.key = '{to}' AND f.key = '{from}'"
            ))
            .await;
        let moved = run_job(&runner, "message-2", &runs, "other").await;
        assert!(
            matches!(&moved, Err(JobError::Store(e)) if e.kind() == StoreErrorKind::Corrupt),
            "{moved:?}"
        );
        assert_eq!(runs.load(Ordering::SeqCst), 2);
    }
}

async fn a_job_result_stored_before_encryption_is_still_done(kind: Kind) {
    let setup = Setup::new(kind).await;
    let runs = Arc::new(AtomicUsize::new(0));
    let before = setup.runner();
    run_job(&before, "message-1", &runs, "done before")
        .await
        .unwrap();
    let after = setup.runner().encrypt_results(keys());
    let again = run_job(&after, "message-1", &runs, "done after")
        .await
        .unwrap();
    assert_eq!(
        again,
        JobOutcome::AlreadyDone(Bytes::from_static(b"done before"))
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// A deploy that turns on encryption and scoping by principal at once
/// (`previous_scope_with(Scope::from_authorization)`), over records stored under the
/// `Authorization` hash: one stored in clear, one sealed, and one stored in clear under
/// the principal already. Each is found where it is (in clear under the previous scope,
/// under the key's hash in the previous scope, in clear in the principal's scope),
/// opened as the record of that scope and key, and replayed; nothing runs again, and
/// the claims taken under the principal are let go. A sealed record whose key the
/// layer no longer has is `500 response-unreadable`, not a run.
async fn records_from_before_principals_and_encryption_replay_under_both(kind: Kind) {
    use common::{app_behind_auth, post_as};
    let setup = Setup::new(kind).await;
    let keys = keys();
    let token = "acct7.first";
    // Before: keys scoped by the Authorization hash, in clear and sealed.
    let (clear, _) = app(setup.layer());
    let in_clear = send(&clear, post_as(token, "in-clear", &body())).await;
    assert_eq!(in_clear.outcome, Some(Outcome::Executed));
    let (sealed, _) = app(setup.layer().encrypt_responses(keys.clone()));
    let was_sealed = send(&sealed, post_as(token, "sealed", &body())).await;
    assert_eq!(was_sealed.outcome, Some(Outcome::Executed));
    let (principal, _) = app_behind_auth(setup.layer());
    let by_principal = send(&principal, post_as(token, "by-principal", &body())).await;
    assert_eq!(by_principal.outcome, Some(Outcome::Executed));

    let new_layer = || {
        setup
            .layer()
            .require_principal(true)
            .previous_scope_with(Scope::from_authorization)
    };
    let (after, counter) = app_behind_auth(new_layer().encrypt_responses(keys.clone()));
    for (key, first) in [
        ("in-clear", &in_clear),
        ("sealed", &was_sealed),
        ("by-principal", &by_principal),
    ] {
        let retry = send(&after, post_as(token, key, &body())).await;
        assert_eq!(
            retry.outcome,
            Some(Outcome::Replayed),
            "{key}: {}",
            retry.status
        );
        assert_eq!(retry.body, first.body, "{key}");
        assert_eq!(retry.header("location"), first.header("location"), "{key}");
        let other = send(&after, post_as(token, key, "{\"card\":\"other\"}")).await;
        assert_eq!(other.problem(), "key-reused", "{key}");
        // The claim under the principal and the key's hash was let go.
        let scope = tower_idempotency::Principal::new("acct7").scope().clone();
        let taken = setup.store.look_up(&scope, &keys.stored_key(key)).await;
        assert!(taken.unwrap().is_none(), "{key}");
    }
    assert_eq!(counter.runs(), 0);
    // A key new everywhere runs once, sealed, under the principal.
    let fresh = send(&after, post_as(token, "fresh", &body())).await;
    assert_eq!(fresh.outcome, Some(Outcome::Executed));
    let refreshed = send(&after, post_as("acct7.second", "fresh", &body())).await;
    assert_eq!(refreshed.outcome, Some(Outcome::Replayed));
    assert_eq!(counter.runs(), 1);

    // Keys that no longer name the sealing key (the same first key's bytes, so the
    // same hashes, under id 9): the sealed record is refused, not run.
    let (dropped, counter) =
        app_behind_auth(new_layer().encrypt_responses(EncryptionKeys::new(9, [0x11; 32])));
    let refused = send(&dropped, post_as(token, "sealed", &body())).await;
    assert_eq!(refused.status, 500);
    assert_eq!(refused.problem(), "response-unreadable");
    assert!(!holds(&refused.body, CARD));
    assert_eq!(counter.runs(), 0);
}

/// What looking through a key's earlier forms costs on PostgreSQL: a replay nothing
/// more, a new key one primary-key read per form: one with encryption alone (the key
/// in clear), three with the previous scope too (in clear in its own scope, hashed and
/// in clear in the previous one), one again once clear records are no longer
/// accepted; none where the previous scope is the request's own and clear records are
/// refused.
#[tokio::test]
async fn a_new_key_costs_one_read_per_earlier_form_and_a_replay_nothing() {
    use common::{app_behind_auth, post_as};
    let schema = TestSchema::new();
    let proxy = common::proxy::PgProxy::start().await;
    let store = schema.store_at(&proxy.url(), 1).await;
    let cost = |router: axum::Router, token: &'static str, key: &'static str| {
        let proxy = &proxy;
        async move {
            let before = proxy.executes();
            let reply = send(&router, post_as(token, key, &body())).await;
            (reply.outcome, proxy.executes() - before)
        }
    };
    let layer = || IdempotencyLayer::new(store.clone());
    let (plain, _) = app_behind_auth(layer());
    let (sealed, _) = app_behind_auth(layer().encrypt_responses(keys()));
    let both = layer()
        .previous_scope_with(Scope::from_authorization)
        .encrypt_responses(keys());
    let (both, _) = app_behind_auth(both);
    let refused = layer()
        .previous_scope_with(Scope::from_authorization)
        .encrypt_responses(keys().accept_clear_records(false));
    let (refused, _) = app_behind_auth(refused);
    // Warmed up: every statement prepared on the one connection.
    for router in [&plain, &sealed, &both, &refused] {
        cost(router.clone(), "acct7.first", "warm-up").await;
    }
    let executed = Some(Outcome::Executed);
    // The claim and the completion, and the reads.
    assert_eq!(cost(plain, "acct7.first", "a").await, (executed, 2));
    assert_eq!(
        cost(sealed.clone(), "acct7.first", "b").await,
        (executed, 3)
    );
    assert_eq!(cost(both.clone(), "acct7.first", "c").await, (executed, 5));
    assert_eq!(
        cost(refused.clone(), "acct7.first", "d").await,
        (executed, 3)
    );
    // No credential: one scope before and after; clear records refused: no read.
    let anonymous = |key| {
        let (proxy, router) = (&proxy, refused.clone());
        async move {
            let before = proxy.executes();
            let reply = send(&router, post(key, &body())).await;
            (reply.outcome, proxy.executes() - before)
        }
    };
    assert_eq!(anonymous("e").await, (executed, 2));
    let replayed = Some(Outcome::Replayed);
    assert_eq!(cost(sealed, "acct7.first", "b").await, (replayed, 1));
    assert_eq!(cost(both, "acct7.second", "c").await, (replayed, 1));
}

/// A completion whose answer was lost with its connection is sent again with the same
/// sealed bytes (sealed once, not once per attempt): PostgreSQL tells it was this
/// completion that landed, so the layer never takes it for a takeover.
#[tokio::test]
async fn a_completion_sent_again_after_its_answer_was_lost_is_the_same_sealed_response() {
    let schema = TestSchema::new();
    let proxy = common::proxy::PgProxy::start().await;
    let store = schema.store_at(&proxy.url(), 1).await;
    let layer = IdempotencyLayer::new(store).encrypt_responses(keys());
    let shutdown = layer.shutdown_handle();
    let (router, counter) = app(layer);
    // Warmed up: the statements are prepared, so the next reply is the completion's.
    assert_eq!(send(&router, post("warm-up", &body())).await.status, 201);

    let (printed, guard) = logs();
    let held = common::post_with_headers("lost", &[("x-held", "1")]);
    let running = common::in_flight(&router, held, &counter).await;
    proxy.cut_at_next_reply();
    counter.let_go(1);
    let first = running.await.unwrap();
    assert_eq!(first.status, 201);
    shutdown.close();
    shutdown.drain().await;
    drop(guard);
    let printed = String::from_utf8(printed.lock().unwrap().clone()).unwrap();
    assert!(printed.contains("storing the result failed"), "{printed}");
    assert!(!printed.contains("taken over"), "{printed}");
    let rows = schema
        .query(&format!(
            "SELECT state FROM \"{}\".idempotency_keys WHERE key = '{}'",
            schema.name,
            keys().stored_key("lost")
        ))
        .await;
    assert_eq!(rows[0].get::<_, String>(0), "completed");
    assert_eq!(counter.runs(), 2);
}
