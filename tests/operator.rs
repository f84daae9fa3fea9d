//! A key's life on demand (`store::Operator`), on each store: a key looked up, the keys
//! left running listed, a running key released (its holder fenced off, its retry run),
//! a completed key deleted (its retry run again), each action logged at `info` with the
//! key's hash and never the key; and `examples/keys.rs` doing the same from a shell.
#![allow(clippy::unwrap_used)] // unwrap in tests: a failure is the test failing

mod common;

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::{Duration, SystemTime},
};

use common::{
    Counter, TestSchema, app, completions::AlteredCompletions, eventually, in_flight, post,
    post_with_headers, send,
};
use tower_idempotency::{
    Fingerprint, IdempotencyLayer, Outcome, Principal, Scope, StoredResponse,
    store::{Claim, ClaimRequest, Fenced, KeyState, Lease, Operator, Removal, Store},
};
use tracing::field::{Field, Visit};
use tracing_subscriber::{Layer, layer::Context, prelude::*};

/// Each test below, on the memory store and on PostgreSQL (a schema of its own).
macro_rules! on_every_store {
    ($($test:ident),* $(,)?) => {
        mod memory {
            $(
                #[tokio::test]
                async fn $test() {
                    super::events();
                    let store = std::sync::Arc::new(tower_idempotency::store::MemoryStore::new());
                    super::$test(store, None).await;
                }
            )*
        }
        mod postgres {
            $(
                #[tokio::test]
                async fn $test() {
                    super::events();
                    let schema = crate::common::TestSchema::new();
                    // Liveness off: a duplicate waiting on a key is then woken by the
                    // release's notification alone, never by liveness's look every
                    // second, so the waiting test shows the notification.
                    let store = schema.store().await.with_liveness(false);
                    // Listening before the first request: a listener that comes up
                    // while a duplicate waits wakes it to look again (anything may have
                    // changed unheard), and it registers a second time.
                    store.listen().await.expect("the LISTEN connection");
                    let store = std::sync::Arc::new(store);
                    super::$test(store, Some(&schema)).await;
                }
            )*
        }
    };
}

on_every_store!(
    a_running_key_released_by_an_operator_fences_its_holder_and_its_retry_runs,
    a_request_running_when_its_key_is_released_gets_its_own_answer_and_the_retry_s_is_kept,
    a_duplicate_waiting_on_a_key_an_operator_releases_is_woken_and_runs_it,
    a_completed_key_deleted_by_an_operator_runs_again,
    a_look_up_says_state_holder_lease_status_sizes_and_times,
    the_list_of_running_keys_holds_old_running_keys_only,
    each_action_is_logged_at_info_with_the_key_s_hash_never_the_key,
);

const LEASE: Duration = Duration::from_secs(30);
const TTL: Duration = Duration::from_secs(3600);

fn scope() -> Scope {
    Principal::new("acct7").scope().clone()
}

fn request<'a>(scope: &'a Scope, key: &'a str) -> ClaimRequest<'a> {
    ClaimRequest {
        scope,
        key,
        fingerprint: Fingerprint::new([7; 32]),
        lease: LEASE,
        ttl: TTL,
    }
}

async fn claim(store: &dyn Store, scope: &Scope, key: &str) -> Lease {
    match store.claim(&request(scope, key)).await.unwrap() {
        Claim::Acquired(lease) => lease,
        other => panic!("{key} is not new: {other:?}"),
    }
}

fn response(body: &'static str) -> StoredResponse {
    let mut headers = http::HeaderMap::new();
    headers.insert("content-type", "text/plain".parse().unwrap());
    headers.insert("location", "/payments/1".parse().unwrap());
    StoredResponse {
        status: http::StatusCode::CREATED,
        headers,
        body: body.into(),
    }
}

async fn a_running_key_released_by_an_operator_fences_its_holder_and_its_retry_runs(
    store: Arc<dyn Store>,
    _: Option<&TestSchema>,
) {
    let scope = scope();
    let lease = claim(&*store, &scope, "order-1").await;
    let operator = Operator::new(store.clone());
    // Not under another holder's token.
    let wrong = lease.token.next();
    let refused = operator
        .release(&scope, "order-1", Some(wrong))
        .await
        .unwrap();
    assert!(
        matches!(&refused, Removal::Refused(r) if r.is_running()),
        "{refused:?}"
    );
    let released = operator
        .release(&scope, "order-1", Some(lease.token))
        .await
        .unwrap();
    assert!(
        matches!(released, Removal::Removed { token } if token == lease.token),
        "{released:?}"
    );
    assert!(store.look_up(&scope, "order-1").await.unwrap().is_none());
    // Its holder can change nothing from now on.
    let late = response("the holder's, late");
    assert_eq!(store.renew(&lease, LEASE).await.unwrap(), Fenced::LeaseLost);
    assert_eq!(
        store.complete(&lease, &late, TTL).await.unwrap(),
        Fenced::LeaseLost
    );
    assert_eq!(store.release(&lease).await.unwrap(), Fenced::LeaseLost);
    // A retry runs the key anew, under a token of its own, and stores its result.
    let retry = claim(&*store, &scope, "order-1").await;
    assert_ne!(retry.token, lease.token);
    let stored = response("the retry's");
    assert_eq!(
        store.complete(&retry, &stored, TTL).await.unwrap(),
        Fenced::Kept
    );
    // Even now the first holder's completion lands nowhere.
    assert_eq!(
        store.complete(&lease, &late, TTL).await.unwrap(),
        Fenced::LeaseLost
    );
    let record = store.look_up(&scope, "order-1").await.unwrap().unwrap();
    assert_eq!(record.token, retry.token);
    assert_eq!(record.response().unwrap().body, "the retry's");
    // A completed key is not released; a key with no record is absent.
    let refused = operator.release(&scope, "order-1", None).await.unwrap();
    assert!(
        matches!(&refused, Removal::Refused(r) if !r.is_running()),
        "{refused:?}"
    );
    let absent = operator
        .release(&scope, "never-claimed", None)
        .await
        .unwrap();
    assert!(matches!(absent, Removal::Absent), "{absent:?}");
}

/// Through the layer: the request whose handler runs when its key is released gets its
/// handler's own answer, stored nowhere; the retry that came meanwhile ran, and its
/// answer is the one replayed.
async fn a_request_running_when_its_key_is_released_gets_its_own_answer_and_the_retry_s_is_kept(
    store: Arc<dyn Store>,
    _: Option<&TestSchema>,
) {
    let (router, counter): (_, Counter) = app(IdempotencyLayer::new(store.clone()));
    let held = in_flight(
        &router,
        post_with_headers("order-2", &[("x-held", "1")]),
        &counter,
    )
    .await;
    let duplicate = send(&router, post("order-2", "{}")).await;
    assert_eq!(duplicate.status, 409);
    let operator = Operator::new(store.clone());
    let running = operator.running(Duration::ZERO, 10).await.unwrap();
    assert_eq!(running.len(), 1);
    let (anonymous, key) = (&running[0].scope, running[0].key.as_str());
    assert_eq!(key, "order-2");
    let released = operator.release(anonymous, key, None).await.unwrap();
    assert!(matches!(released, Removal::Removed { .. }), "{released:?}");
    // The retry runs, at once.
    let retry = send(&router, post("order-2", "{}")).await;
    assert_eq!(
        (retry.status.as_u16(), retry.outcome),
        (201, Some(Outcome::Executed))
    );
    assert_eq!(counter.runs_of("order-2"), 2);
    // The first run ends: its client gets its answer; the key keeps the retry's.
    counter.let_go(1);
    let first = held.await.unwrap();
    assert_eq!(first.status, 201);
    assert_eq!(first.header("x-run"), Some("1"));
    let replay = send(&router, post("order-2", "{}")).await;
    assert_eq!(replay.outcome, Some(Outcome::Replayed));
    assert_eq!(replay.header("x-run"), Some("2"));
    assert_eq!(counter.runs_of("order-2"), 2);
}

/// A duplicate told to wait for the running request is woken by the release (its
/// store's notification), not by its bound: it claims the key and runs it.
async fn a_duplicate_waiting_on_a_key_an_operator_releases_is_woken_and_runs_it(
    store: Arc<dyn Store>,
    _: Option<&TestSchema>,
) {
    let (counted, counts) = AlteredCompletions::counting(store.clone());
    let layer = IdempotencyLayer::new(counted).wait_for_running(Duration::from_secs(20));
    let (router, counter) = app(layer);
    let held = in_flight(
        &router,
        post_with_headers("order-6", &[("x-held", "1")]),
        &counter,
    )
    .await;
    let waiting = {
        let router = router.clone();
        tokio::spawn(async move { send(&router, post("order-6", "{}")).await })
    };
    // It found the key running, and waits for it to change.
    eventually(|| counts.registrations() == 1).await;
    assert!(!waiting.is_finished());
    let released = Operator::new(store.clone())
        .release(&Scope::anonymous(), "order-6", None)
        .await
        .unwrap();
    assert!(matches!(released, Removal::Removed { .. }), "{released:?}");
    let woken = tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .expect("woken by the release, well within its 20 s wait")
        .unwrap();
    assert_eq!(
        (woken.status.as_u16(), woken.outcome),
        (201, Some(Outcome::Executed))
    );
    assert_eq!(counter.runs_of("order-6"), 2);
    counter.let_go(1);
    assert_eq!(held.await.unwrap().status, 201);
}

async fn a_completed_key_deleted_by_an_operator_runs_again(
    store: Arc<dyn Store>,
    _: Option<&TestSchema>,
) {
    let (router, counter) = app(IdempotencyLayer::new(store.clone()));
    assert_eq!(send(&router, post("order-3", "{}")).await.status, 201);
    assert_eq!(
        send(&router, post("order-3", "{}")).await.outcome,
        Some(Outcome::Replayed)
    );
    let operator = Operator::new(store.clone());
    let anonymous = Scope::anonymous();
    let deleted = operator.delete(&anonymous, "order-3").await.unwrap();
    assert!(matches!(deleted, Removal::Removed { .. }), "{deleted:?}");
    let again = send(&router, post("order-3", "{}")).await;
    assert_eq!(
        (again.status.as_u16(), again.outcome),
        (201, Some(Outcome::Executed))
    );
    assert_eq!(again.header("x-run"), Some("2"));
    assert_eq!(counter.runs_of("order-3"), 2);
    // A running key is not deleted; a key with no record is absent.
    let scope = scope();
    let lease = claim(&*store, &scope, "order-4").await;
    let refused = operator.delete(&scope, "order-4").await.unwrap();
    assert!(
        matches!(&refused, Removal::Refused(r) if r.is_running()),
        "{refused:?}"
    );
    assert_eq!(store.renew(&lease, LEASE).await.unwrap(), Fenced::Kept);
    let absent = operator.delete(&scope, "never-claimed").await.unwrap();
    assert!(matches!(absent, Removal::Absent), "{absent:?}");
}

async fn a_look_up_says_state_holder_lease_status_sizes_and_times(
    store: Arc<dyn Store>,
    _: Option<&TestSchema>,
) {
    let scope = scope();
    let operator = Operator::new(store.clone());
    assert!(operator.look_up(&scope, "order-5").await.unwrap().is_none());
    // PostgreSQL's clock is this machine's, to the microsecond.
    let before = SystemTime::now() - Duration::from_millis(1);
    let lease = claim(&*store, &scope, "order-5").await;
    let claimed = SystemTime::now() + Duration::from_millis(1);
    let running = operator.look_up(&scope, "order-5").await.unwrap().unwrap();
    assert_eq!(running.token, lease.token);
    assert_eq!(running.fingerprint, Fingerprint::new([7; 32]));
    let KeyState::Running { lease_left } = running.state else {
        panic!("{running:?}")
    };
    assert!(
        lease_left > Duration::ZERO && lease_left <= LEASE,
        "{lease_left:?}"
    );
    assert!(
        running.expires_in > LEASE && running.expires_in <= TTL,
        "{running:?}"
    );
    let claimed_at = running.claimed_at.unwrap();
    assert!(before <= claimed_at && claimed_at <= claimed, "{running:?}");
    assert_eq!(running.completed_at, None);

    let stored = response("{\"payment\":1}");
    assert!(
        store
            .complete(&lease, &stored, TTL)
            .await
            .unwrap()
            .is_kept()
    );
    let completed_by = SystemTime::now() + Duration::from_millis(1);
    let done = operator.look_up(&scope, "order-5").await.unwrap().unwrap();
    assert_eq!(done.token, lease.token);
    let response = done.response().unwrap();
    assert_eq!(response.status, 201);
    assert_eq!(response.body.len(), 13);
    assert_eq!(response.headers.len(), 2);
    assert_eq!(
        StoredResponse::encode_headers(&response.headers).len(),
        StoredResponse::encode_headers(&stored.headers).len()
    );
    assert_eq!(done.claimed_at, Some(claimed_at));
    let completed_at = done.completed_at.unwrap();
    assert!(
        claimed_at <= completed_at && completed_at <= completed_by,
        "{done:?}"
    );
    assert!(
        done.expires_in > Duration::ZERO && done.expires_in <= TTL,
        "{done:?}"
    );
}

async fn the_list_of_running_keys_holds_old_running_keys_only(
    store: Arc<dyn Store>,
    schema: Option<&TestSchema>,
) {
    let scope = scope();
    let operator = Operator::new(store.clone());
    let old: Vec<Lease> = [
        claim(&*store, &scope, "old-1").await,
        claim(&*store, &scope, "old-2").await,
        claim(&*store, &scope, "old-3").await,
    ]
    .into();
    let done = claim(&*store, &scope, "old-done").await;
    assert!(
        store
            .complete(&done, &response("{}"), TTL)
            .await
            .unwrap()
            .is_kept()
    );
    let older_than = match schema {
        // Claimed an hour ago (and in that order), as far as the table says; the
        // completed one too.
        Some(schema) => {
            schema
                .query(&format!(
                    "UPDATE \"{}\".idempotency_keys AS k
                     SET created_at = now() - interval '1 hour' + v.shift
                     FROM (VALUES ('old-1', interval '1 s'), ('old-2', interval '2 s'),
                                  ('old-3', interval '3 s'), ('old-done', interval '0 s'))
                          AS v(key, shift)
                     WHERE k.key = v.key",
                    schema.name
                ))
                .await;
            Duration::from_secs(1800)
        }
        // The memory store keeps its own clock: the old keys are older by a second and
        // a half than the new one, claimed just before the list.
        None => {
            tokio::time::sleep(Duration::from_millis(1500)).await;
            Duration::from_secs(1)
        }
    };
    let new = claim(&*store, &scope, "new").await;
    let listed = operator.running(older_than, 10).await.unwrap();
    let keys: Vec<&str> = listed.iter().map(|k| k.key.as_str()).collect();
    assert_eq!(keys, ["old-1", "old-2", "old-3"]);
    for (listed, lease) in listed.iter().zip(&old) {
        assert_eq!((&listed.scope, listed.record.token), (&scope, lease.token));
        assert!(listed.record.is_running());
    }
    // Bounded, oldest first.
    let two = operator.running(older_than, 2).await.unwrap();
    let keys: Vec<&str> = two.iter().map(|k| k.key.as_str()).collect();
    assert_eq!(keys, ["old-1", "old-2"]);
    // With no bound on age, the new key too; never the completed one.
    let all = operator.running(Duration::ZERO, 10).await.unwrap();
    let keys: Vec<&str> = all.iter().map(|k| k.key.as_str()).collect();
    assert_eq!(keys, ["old-1", "old-2", "old-3", "new"]);
    assert_eq!(all[3].record.token, new.token);
}

async fn each_action_is_logged_at_info_with_the_key_s_hash_never_the_key(
    store: Arc<dyn Store>,
    _: Option<&TestSchema>,
) {
    let events = events();
    let scope = Scope::new("principal:alice@example.com");
    // Its own key: the other store's run of this test logs beside it.
    let key = common::unique_name("alice-order");
    let key = key.as_str();
    let operator = Operator::new(store.clone());
    claim(&*store, &scope, key).await;
    operator.look_up(&scope, key).await.unwrap();
    operator.running(Duration::ZERO, 10).await.unwrap();
    operator.release(&scope, key, None).await.unwrap();
    let lease = claim(&*store, &scope, key).await;
    assert!(
        store
            .complete(&lease, &response("{}"), TTL)
            .await
            .unwrap()
            .is_kept()
    );
    operator.delete(&scope, key).await.unwrap();

    let hash = Operator::hash(key);
    let logged: Vec<_> = (events.0.lock().unwrap().iter())
        .filter(|e| e.get("key_hash") == Some(&hash) || e["message"].contains("listed"))
        .cloned()
        .collect();
    let of = |text: &str| {
        let found: Vec<_> = logged
            .iter()
            .filter(|e| e["message"].contains(text))
            .collect();
        assert_eq!(found.len(), 1, "one event for {text:?}: {logged:#?}");
        found[0].clone()
    };
    for (text, token) in [
        ("looked an idempotency key up", None),
        ("released a running idempotency key", None),
        (
            "deleted a completed idempotency key",
            Some(lease.token.get().to_string()),
        ),
    ] {
        let event = of(text);
        assert_eq!(event["level"], "INFO", "{event:?}");
        assert_eq!(event["key_hash"], Operator::hash(key), "{event:?}");
        assert_eq!(
            event["scope_hash"],
            Operator::hash(scope.as_str()),
            "{event:?}"
        );
        if let Some(token) = token {
            assert_eq!(event["token"], token, "{event:?}");
        }
    }
    let listed: Vec<_> = logged
        .iter()
        .filter(|e| e["message"].contains("listed"))
        .collect();
    assert!(listed.iter().all(|e| e["level"] == "INFO"), "{listed:?}");
    // Neither the key nor the scope, in clear, in any field of any event of this crate
    // (the driver's own statement logs, at `debug`, are the app's to filter).
    let all = events.0.lock().unwrap().clone();
    for event in all
        .iter()
        .filter(|e| e["target"].starts_with("tower_idempotency"))
    {
        for value in event.values() {
            assert!(
                !value.contains(key) && !value.contains("alice@"),
                "{event:?}"
            );
        }
    }
}

/// The fields of every event, its message, level and target included.
#[derive(Clone, Default)]
struct Events(Arc<Mutex<Vec<HashMap<String, String>>>>);

/// The events of this test binary, recorded by a subscriber set for the whole process
/// by the first test to start (every test calls this first): one set for a test's
/// thread alone (`set_default`) can miss an event whose callsite another test's thread,
/// without a subscriber, registers at the same moment.
fn events() -> &'static Events {
    static EVENTS: std::sync::OnceLock<Events> = std::sync::OnceLock::new();
    EVENTS.get_or_init(|| {
        let events = Events::default();
        tracing_subscriber::registry()
            .with(events.clone())
            .try_init()
            .expect("no other subscriber in this test binary");
        events
    })
}

#[derive(Default)]
struct Fields(HashMap<String, String>);

impl Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.insert(field.name().to_owned(), format!("{value:?}"));
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_owned(), value.to_owned());
    }
}

impl<S: tracing::Subscriber> Layer<S> for Events {
    fn on_event(&self, event: &tracing::Event<'_>, _: Context<'_, S>) {
        let mut fields = Fields::default();
        event.record(&mut fields);
        let level = event.metadata().level().to_string();
        fields.0.insert("level".to_owned(), level);
        let target = event.metadata().target().to_owned();
        fields.0.insert("target".to_owned(), target);
        self.0.lock().unwrap().push(fields.0);
    }
}

/// `examples/keys.rs` from a shell, against a schema of its own: the key shown, listed,
/// released (its holder then refused), and, completed by its retry, deleted.
#[tokio::test]
async fn the_keys_tool_shows_lists_releases_and_deletes_a_key() {
    events();
    let schema = TestSchema::new();
    let store = schema.store().await;
    let scope = scope();
    let lease = claim(&store, &scope, "order-9").await;
    let keys = |args: &[&str]| {
        let out = std::process::Command::new(tool())
            .env("DATABASE_URL", common::database_url())
            .env("RUST_LOG", "info")
            .args(["--schema", &schema.name])
            .args(args)
            .output()
            .unwrap();
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        (out.status.code(), text(&out.stdout), text(&out.stderr))
    };
    let (code, out, _) = keys(&["show", "principal:acct7", "order-9"]);
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("state running"), "{out}");
    assert!(out.contains(&format!("token {}", lease.token)), "{out}");
    assert!(
        out.contains(&format!("key hash {}", Operator::hash("order-9"))),
        "{out}"
    );

    let (code, out, _) = keys(&["running", "--older-than", "0"]);
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("\"principal:acct7\" \"order-9\""), "{out}");

    let (code, out, err) = keys(&["release", "principal:acct7", "order-9"]);
    assert_eq!(code, Some(0), "{out}");
    assert!(
        out.contains(&format!("released (token {})", lease.token)),
        "{out}"
    );
    assert!(
        err.contains("INFO") && err.contains(&Operator::hash("order-9")),
        "{err}"
    );
    assert!(!err.contains("order-9"), "the key in clear: {err}");
    assert_eq!(
        store
            .complete(&lease, &response("late"), TTL)
            .await
            .unwrap(),
        Fenced::LeaseLost
    );
    let retry = claim(&store, &scope, "order-9").await;
    assert!(
        store
            .complete(&retry, &response("{}"), TTL)
            .await
            .unwrap()
            .is_kept()
    );

    let (code, out, _) = keys(&["release", "principal:acct7", "order-9"]);
    assert_eq!(code, Some(1), "a completed key is not released: {out}");
    assert!(out.contains("state completed, status 201"), "{out}");
    let (code, out, _) = keys(&["delete", "principal:acct7", "order-9"]);
    assert_eq!(code, Some(0), "{out}");
    assert!(store.look_up(&scope, "order-9").await.unwrap().is_none());
    let (code, _, err) = keys(&["delete", "principal:acct7"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("usage"), "{err}");
}

/// `target/<profile>/examples/keys`, next to this test's `target/<profile>/deps/`.
fn tool() -> std::path::PathBuf {
    let exe = std::env::current_exe().unwrap();
    let profile_dir = exe.parent().and_then(|deps| deps.parent()).unwrap();
    let bin = profile_dir
        .join("examples")
        .join(format!("keys{}", std::env::consts::EXE_SUFFIX));
    assert!(
        bin.is_file(),
        "the keys tool is not built at {}: run `cargo build --example keys` (or `cargo \
         test`, which builds the examples) first",
        bin.display()
    );
    bin
}
