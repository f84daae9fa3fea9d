//! The outcome of every guarded request is a field of the `idempotency` tracing span,
//! next to the scope's hash and the key (or its hash).
#![allow(clippy::unwrap_used)] // unwrap in test helpers: a failure is the test failing

mod common;

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
};

use common::{
    app,
    completions::{AlteredCompletions, Completion},
    eventually, post, post_with_headers, send,
};
use tower_idempotency::{
    IdempotencyLayer, Scope,
    job::{JobOutcome, JobRunner},
    store::MemoryStore,
};
use tracing::{
    Subscriber,
    field::{Field, Visit},
    span,
};
use tracing_subscriber::{Layer, layer::Context, prelude::*, registry::LookupSpan};

/// The fields of every closed `idempotency` span.
#[derive(Clone, Default)]
struct Spans(Arc<Mutex<Vec<HashMap<String, String>>>>);

/// The fields of every event, its message included.
#[derive(Clone, Default)]
struct Events(Arc<Mutex<Vec<HashMap<String, String>>>>);

impl Events {
    /// The events at `level` whose message contains `text`.
    fn at(&self, level: &str, text: &str) -> Vec<HashMap<String, String>> {
        let events = self.0.lock().unwrap();
        events
            .iter()
            .filter(|e| e["level"] == level && e["message"].contains(text))
            .cloned()
            .collect()
    }

    fn messages(&self) -> Vec<String> {
        let events = self.0.lock().unwrap();
        events.iter().map(|e| e["message"].clone()).collect()
    }

    /// Returns once the storing of a result that cannot be stored has given up: every
    /// event about it has then been recorded.
    async fn until_storing_gives_up(&self) {
        eventually(|| {
            self.messages()
                .iter()
                .any(|m| m.starts_with("the result could not be stored"))
        })
        .await;
    }
}

/// Spans and events recorded on this thread until the guard is dropped.
fn recording() -> (Spans, Events, tracing::subscriber::DefaultGuard) {
    let (spans, events) = (Spans::default(), Events::default());
    let guard = tracing_subscriber::registry()
        .with(spans.clone())
        .with(events.clone())
        .set_default();
    (spans, events, guard)
}

impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for Events {
    /// The event's fields, and its span's name and key as `span` and `span.key`.
    fn on_event(&self, event: &tracing::Event<'_>, ctx: Context<'_, S>) {
        let mut fields = Fields::default();
        event.record(&mut fields);
        fields
            .0
            .insert("level".to_owned(), event.metadata().level().to_string());
        if let Some(span) = ctx.event_span(event) {
            fields.0.insert("span".to_owned(), span.name().to_owned());
            if let Some(key) = span
                .extensions()
                .get::<Fields>()
                .and_then(|f| f.0.get("key").cloned())
            {
                fields.0.insert("span.key".to_owned(), key);
            }
        }
        self.0.lock().unwrap().push(fields.0);
    }
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

impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for Spans {
    fn on_new_span(&self, attrs: &span::Attributes<'_>, id: &span::Id, ctx: Context<'_, S>) {
        let mut fields = Fields::default();
        attrs.record(&mut fields);
        if let Some(span) = ctx.span(id) {
            span.extensions_mut().insert(fields);
        }
    }

    fn on_record(&self, id: &span::Id, values: &span::Record<'_>, ctx: Context<'_, S>) {
        if let Some(span) = ctx.span(id)
            && let Some(fields) = span.extensions_mut().get_mut::<Fields>()
        {
            values.record(fields);
        }
    }

    fn on_close(&self, id: span::Id, ctx: Context<'_, S>) {
        if let Some(span) = ctx.span(&id)
            && span.name() == "idempotency"
            && let Some(fields) = span.extensions().get::<Fields>()
        {
            self.0.lock().unwrap().push(fields.0.clone());
        }
    }
}

#[tokio::test]
async fn every_guarded_request_has_a_span_with_its_outcome() {
    let spans = Spans::default();
    let _guard = tracing_subscriber::registry()
        .with(spans.clone())
        .set_default();
    let (router, _) = app(IdempotencyLayer::new(MemoryStore::new()));
    send(&router, post("order-42", "{}")).await;
    send(&router, post("order-42", "{}")).await;
    send(&router, post("order-42", "{\"other\":1}")).await;
    send(
        &router,
        post_with_headers("order-43", &[("x-status", "500")]),
    )
    .await;
    let seen = spans.0.lock().unwrap().clone();
    let outcomes: Vec<_> = seen
        .iter()
        .map(|f| f["idempotency.outcome"].as_str())
        .collect();
    assert_eq!(outcomes, ["executed", "replayed", "mismatch", "released"]);
    // The key is hashed by default: the same hash on each of its requests.
    assert!(
        seen[..3]
            .iter()
            .all(|f| f["key"].len() == 16 && f["key"] == seen[0]["key"])
    );
    assert!(seen.iter().all(|f| !f["key"].contains("order-42")));
    // The scope is recorded as a hash, never as the principal itself.
    assert!(seen.iter().all(|f| f["scope"].len() == 16));
}

#[tokio::test]
async fn keys_are_in_traces_in_clear_only_when_asked() {
    let spans = Spans::default();
    let _guard = tracing_subscriber::registry()
        .with(spans.clone())
        .set_default();
    let (router, _) = app(IdempotencyLayer::new(MemoryStore::new()));
    send(&router, post("alice@example.com", "{}")).await;
    let (router, _) = app(IdempotencyLayer::new(MemoryStore::new()).hash_keys_in_traces(false));
    send(&router, post("bob@example.com", "{}")).await;
    let seen = spans.0.lock().unwrap().clone();
    assert_eq!(seen.len(), 2);
    assert_ne!(seen[0]["key"], "alice@example.com");
    assert_eq!(seen[0]["key"].len(), 16);
    assert_eq!(seen[1]["key"], "bob@example.com");
}

/// What the usual `fmt` subscriber prints while a guarded request logs an event of its
/// own, on a layer built by `layer`.
async fn printed_by_fmt(layer: IdempotencyLayer, key: &str) -> String {
    use axum::{Router, routing::post as route_post};
    let out = Arc::new(Mutex::new(Vec::<u8>::new()));
    let sink = out.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_ansi(false)
        .with_writer(move || Sink(sink.clone()))
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);
    let router = Router::new()
        .route(
            "/payments",
            route_post(|| async {
                tracing::info!("charging the card");
                "charged"
            }),
        )
        .layer(layer);
    assert_eq!(send(&router, post(key, "{}")).await.status, 200);
    let printed = String::from_utf8(out.lock().unwrap().clone()).unwrap();
    assert!(printed.contains("charging the card"), "{printed}");
    printed
}

/// A writer into a shared buffer, for the `fmt` subscriber.
struct Sink(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Sink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tokio::test]
async fn the_default_fmt_output_never_prints_the_key() {
    let key = "order-7f3a9c2e-secret";
    let printed = printed_by_fmt(IdempotencyLayer::new(MemoryStore::new()), key).await;
    assert!(
        !printed.contains(key),
        "the key in clear in the logs: {printed}"
    );
    assert!(printed.contains("idempotency{key="), "{printed}");
    // Asked for, it is printed as sent.
    let layer = IdempotencyLayer::new(MemoryStore::new()).hash_keys_in_traces(false);
    let printed = printed_by_fmt(layer, key).await;
    assert!(printed.contains(key), "{printed}");
}

#[tokio::test]
async fn a_hashed_key_is_in_no_event_either() {
    let (spans, events, _guard) = recording();
    // Every completion fails: the layer warns of each attempt, then gives up after one
    // more lease with an error.
    let store = AlteredCompletions::around(Arc::new(MemoryStore::new()), Completion::Failing);
    let layer = IdempotencyLayer::new(store).lease_duration(std::time::Duration::from_millis(100));
    let (router, _) = app(layer);
    assert_eq!(
        send(&router, post("alice@example.com", "{}")).await.status,
        201
    );
    events.until_storing_gives_up().await;
    let messages = events.messages();
    assert!(
        messages.iter().any(|m| m == "storing the result failed"),
        "{messages:?}"
    );
    let events = events.0.lock().unwrap().clone();
    for event in &events {
        for (name, value) in event {
            assert!(
                !value.contains("alice@example.com"),
                "the key in clear in the field {name} of {event:?}"
            );
        }
    }
    // The span that carries those events has the key's hash.
    let seen = spans.0.lock().unwrap().clone();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0]["key"].len(), 16);
}

#[tokio::test]
async fn a_job_s_events_are_in_a_span_with_its_key() {
    let (_spans, events, _guard) = recording();
    let store = AlteredCompletions::around(Arc::new(MemoryStore::new()), Completion::Failing);
    let runner = JobRunner::new(store).lease_duration(std::time::Duration::from_millis(100));
    let ran = runner
        .run(&Scope::new("consumer"), "msg-7", b"p", |_| async {
            Ok::<_, std::io::Error>(bytes::Bytes::from("done"))
        })
        .await
        .unwrap();
    assert!(matches!(ran, JobOutcome::Ran(_)));
    events.until_storing_gives_up().await;
    let events = events.0.lock().unwrap().clone();
    let storing: Vec<_> = events
        .iter()
        .filter(|e| e["message"].contains("stor"))
        .collect();
    assert!(!storing.is_empty());
    for event in storing {
        assert_eq!(
            event.get("span").map(String::as_str),
            Some("job"),
            "{event:?}"
        );
        assert_eq!(
            event.get("span.key").map(String::as_str),
            Some("msg-7"),
            "{event:?}"
        );
    }
}

/// A renewal that finds the lease gone while the result's first attempt is on its way
/// may only have come after that attempt landed: no warning that the result is lost,
/// since it is not.
#[tokio::test]
async fn a_completion_that_lands_before_its_answer_raises_no_false_alarm() {
    let (_spans, events, _guard) = recording();
    let store = AlteredCompletions::around(
        Arc::new(MemoryStore::new()),
        Completion::AnsweredLate(std::time::Duration::from_millis(400)),
    );
    let layer = IdempotencyLayer::new(store).lease_duration(std::time::Duration::from_millis(150));
    let (router, counter) = app(layer);
    assert_eq!(send(&router, post("k", "{}")).await.status, 201);
    let replay = send(&router, post("k", "{}")).await;
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(counter.runs_of("k"), 1);
    let messages = events.messages();
    assert!(
        messages
            .iter()
            .any(|m| m.starts_with("a renewal found the lease gone")),
        "no renewal met the landed result: {messages:?}"
    );
    assert!(
        !messages.iter().any(|m| m.starts_with("the lease was lost")),
        "{messages:?}"
    );
}

/// The lease is renewed by a task of its own, whose warnings are still the request's:
/// in its span, with its key.
#[tokio::test]
async fn a_failed_renewal_is_logged_in_the_request_s_span() {
    let (_spans, events, _guard) = recording();
    let store = AlteredCompletions::around(Arc::new(MemoryStore::new()), Completion::RenewalsFail);
    // Renewed every 20 ms; the key in clear, to tell the request's span.
    let layer = IdempotencyLayer::new(store)
        .lease_duration(std::time::Duration::from_millis(60))
        .hash_keys_in_traces(false);
    let (router, counter) = app(layer);
    let held = common::post_with_headers("order-7", &[("x-held", "1")]);
    let request = common::in_flight(&router, held, &counter).await;
    let failed = || {
        let events = events.0.lock().unwrap();
        events
            .iter()
            .find(|e| e["message"] == "lease renewal failed")
            .cloned()
    };
    eventually(|| failed().is_some()).await;
    counter.let_go(1);
    request.await.unwrap();
    let event = failed().unwrap();
    assert_eq!(event.get("span").map(String::as_str), Some("idempotency"));
    assert_eq!(event.get("span.key").map(String::as_str), Some("order-7"));
}

/// What the default `fmt` subscriber prints, at `debug`, into a buffer of the test's
/// own, until the guard is dropped.
fn printed_at_debug() -> (Arc<Mutex<Vec<u8>>>, tracing::subscriber::DefaultGuard) {
    let out = Arc::new(Mutex::new(Vec::<u8>::new()));
    let sink = out.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_ansi(false)
        .with_max_level(tracing::Level::DEBUG)
        .with_writer(move || Sink(sink.clone()))
        .finish();
    (out, tracing::subscriber::set_default(subscriber))
}

/// The lines of `out` that name an outcome.
fn outcome_lines(out: &Mutex<Vec<u8>>) -> Vec<String> {
    let printed = String::from_utf8(out.lock().unwrap().clone()).unwrap();
    printed
        .lines()
        .filter(|l| l.contains(" idempotency.outcome="))
        .map(str::to_owned)
        .collect()
}

/// The first 16 hex digits of the SHA-256 of `key`, as the span carries it.
fn hashed(key: &str) -> String {
    use sha2::Digest;
    let digest = sha2::Sha256::digest(key.as_bytes());
    digest[..8].iter().map(|b| format!("{b:02x}")).collect()
}

/// With nothing but the usual `fmt` subscriber, each guarded request prints one line
/// saying what the layer did with it: its outcome, status, mode, method and route, in
/// the request's span (with the key's hash, never the key), at a level by what it
/// means: `debug` for a request whose handler ran, `info` for a duplicate answered in
/// its stead or a refused key, `warn` for a key reused with another request.
#[tokio::test]
async fn every_outcome_is_printed_by_the_default_fmt_subscriber() {
    let (out, _guard) = printed_at_debug();
    let layer = IdempotencyLayer::new(MemoryStore::new()).require_key(true);
    let (router, counter) = app(layer);
    let line = |outcome: &str| {
        let lines = outcome_lines(&out);
        let found: Vec<_> = lines
            .iter()
            .filter(|l| l.contains(&format!(" idempotency.outcome=\"{outcome}\"")))
            .cloned()
            .collect();
        assert_eq!(found.len(), 1, "one line for {outcome}: {lines:#?}");
        found[0].clone()
    };

    assert_eq!(send(&router, post("order-1", "{}")).await.status, 201);
    let executed = line("executed");
    assert_eq!(send(&router, post("order-1", "{}")).await.status, 201);
    let replayed = line("replayed");
    // A duplicate while the first request with its key still runs.
    let held = common::post_with_headers("order-2", &[("x-held", "1")]);
    let first = common::in_flight(&router, held, &counter).await;
    assert_eq!(send(&router, post("order-2", "{}")).await.status, 409);
    let conflict = line("conflict");
    counter.let_go(1);
    assert_eq!(first.await.unwrap().status, 201);
    assert_eq!(
        send(&router, post("order-1", "{\"amount\":2}"))
            .await
            .status,
        422
    );
    let mismatch = line("mismatch");
    // A 5xx: the handler ran, and its key was released for a retry.
    let failing = common::post_with_headers("order-4", &[("x-status", "500")]);
    assert_eq!(send(&router, failing).await.status, 500);
    let released = line("released");

    for (line, level, status, key) in [
        (&executed, "DEBUG", 201, "order-1"),
        (&replayed, " INFO", 201, "order-1"),
        (&conflict, " INFO", 409, "order-2"),
        (&mismatch, " WARN", 422, "order-1"),
        (&released, "DEBUG", 500, "order-4"),
    ] {
        assert!(line.contains(level), "{line}");
        let status = format!(" http.response.status_code={status}");
        assert!(line.contains(&status), "{line}");
        assert!(line.contains(" idempotency.mode=\"lease\""), "{line}");
        assert!(line.contains(" http.request.method=\"POST\""), "{line}");
        assert!(line.contains(" http.route=\"/payments\""), "{line}");
        // In the request's span, with the key's hash.
        assert!(
            line.contains(&format!("idempotency{{key=\"{}\"", hashed(key))),
            "{line}"
        );
        assert!(!line.contains(key), "the key in clear: {line}");
    }

    // Refused keys: no key at all, and one that is not a key. No span yet.
    let none = common::req("POST")
        .body(axum::body::Body::from("{}"))
        .unwrap();
    assert_eq!(send(&router, none).await.status, 400);
    let malformed = post("order 3", "{}");
    assert_eq!(send(&router, malformed).await.status, 400);
    let lines = outcome_lines(&out);
    let rejected: Vec<_> = lines
        .iter()
        .filter(|l| l.contains(" idempotency.outcome=\"rejected\""))
        .collect();
    assert_eq!(rejected.len(), 2, "{lines:#?}");
    assert!(
        rejected[0].contains(" idempotency.problem=\"key-missing\""),
        "{lines:#?}"
    );
    assert!(
        rejected[1].contains(" idempotency.problem=\"key-malformed\""),
        "{lines:#?}"
    );
    for line in rejected {
        assert!(line.contains(" INFO"), "{line}");
        assert!(line.contains(" http.response.status_code=400"), "{line}");
        assert!(line.contains(" idempotency.reason="), "{line}");
        assert!(!line.contains("order 3"), "the key in clear: {line}");
    }
    // One line per request: six requests, one that waited held, and two refused.
    assert_eq!(lines.len(), 8, "{lines:#?}");
}

/// A job's outcome is printed too, in its span.
#[tokio::test]
async fn a_job_s_outcome_is_printed_by_the_default_fmt_subscriber() {
    let (out, _guard) = printed_at_debug();
    let runner = JobRunner::new(MemoryStore::new());
    let scope = Scope::new("consumer");
    for input in [&b"a"[..], b"a", b"b"] {
        let _ = runner
            .run(&scope, "msg-1", input, |_| async {
                Ok::<_, std::io::Error>(bytes::Bytes::from("done"))
            })
            .await;
    }
    // Work that fails: its key is released, for a redelivery to run it again.
    let failed = runner
        .run(&scope, "msg-2", b"a", |_| async {
            Err::<bytes::Bytes, _>(std::io::Error::other("the ledger is down"))
        })
        .await;
    assert!(failed.is_err());
    let lines = outcome_lines(&out);
    assert_eq!(lines.len(), 4, "{lines:#?}");
    for (line, outcome, result) in [
        (&lines[0], "executed", "ran"),
        (&lines[1], "replayed", "already_done"),
        (&lines[2], "mismatch", "mismatch"),
        (&lines[3], "released", "failed"),
    ] {
        assert!(
            line.contains(&format!(" idempotency.outcome=\"{outcome}\"")),
            "{line}"
        );
        assert!(
            line.contains(&format!(" idempotency.result=\"{result}\"")),
            "{line}"
        );
        assert!(line.contains("job{key=\"msg-"), "{line}");
    }
}

/// `migrate()` on a schema that exists already (a DBA made it; another replica
/// migrated at the same moment) makes PostgreSQL send notices (`schema … already
/// exists, skipping`), which tokio-postgres logs at `info` through `log`: nothing went
/// wrong, and nothing of it is printed.
#[tokio::test]
async fn migrating_prints_no_notice_of_postgresql() {
    // tokio-postgres logs notices with `log`; its records reach the subscriber as
    // `tracing` events, as they do in an app whose subscriber was set with `init()`.
    let _ = tracing_log::LogTracer::init();
    let out = Arc::new(Mutex::new(Vec::<u8>::new()));
    let sink = out.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_ansi(false)
        .with_max_level(tracing::Level::TRACE)
        .with_writer(move || Sink(sink.clone()))
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);
    let schema = common::TestSchema::new();
    schema
        .query(&format!("CREATE SCHEMA \"{}\"", schema.name))
        .await;
    let (a, b) = (
        schema.unmigrated_store_at(&common::database_url()),
        schema.unmigrated_store_at(&common::database_url()),
    );
    // Two replicas at once (one waits for the other's lock, then finds its objects),
    // then once more.
    let (first, second) = tokio::join!(a.migrate(), b.migrate());
    first.unwrap();
    second.unwrap();
    a.migrate().await.unwrap();
    // The subscriber sees tokio-postgres's records: a statement logged at `debug`.
    let printed = String::from_utf8(out.lock().unwrap().clone()).unwrap();
    assert!(printed.contains("tokio_postgres"), "{printed}");
    assert!(!printed.contains("NOTICE"), "{printed}");
}

/// What the anonymous fallback says of credentials it ignores: once per layer, at
/// `warn`, naming the route, the header and the fix. A request with a principal, or a
/// header not named as a credential, says nothing.
#[tokio::test]
async fn credentials_the_anonymous_scope_ignores_are_warned_of_once_per_layer() {
    let (_spans, events, _guard) = recording();
    const IGNORED: &str = "does not scope by";
    let (router, _) = app(IdempotencyLayer::new(MemoryStore::new()));
    send(&router, post_with_headers("a", &[("cookie", "session=1")])).await;
    send(&router, post_with_headers("b", &[("cookie", "session=2")])).await;
    send(&router, post_with_headers("c", &[("x-api-key", "k-1")])).await;
    let warned = events.at("WARN", IGNORED);
    assert_eq!(warned.len(), 1, "{:#?}", events.0.lock().unwrap());
    assert_eq!(warned[0]["route"], "/payments");
    assert_eq!(warned[0]["header"], "cookie");
    assert!(warned[0]["message"].contains("Principal"), "{warned:?}");

    // Another layer warns of its own, here of an API key.
    let (router, _) = app(IdempotencyLayer::new(MemoryStore::new()));
    send(&router, post_with_headers("a", &[("x-api-key", "k-1")])).await;
    let warned = events.at("WARN", IGNORED);
    assert_eq!(warned.len(), 2);
    assert_eq!(warned[1]["header"], "x-api-key");

    // With the principal in the request, the cookie is nobody's concern.
    let (router, _) = common::app_behind_auth(IdempotencyLayer::new(MemoryStore::new()));
    let mut req = common::post_as("acct7.first", "a", "{}");
    req.headers_mut()
        .insert("cookie", "session=1".parse().unwrap());
    send(&router, req).await;
    // Nor is a header the app does not name, where it names its own.
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .credential_headers([http::HeaderName::from_static("x-session")]);
    let (router, _) = app(layer);
    send(&router, post_with_headers("a", &[("cookie", "session=1")])).await;
    assert_eq!(events.at("WARN", IGNORED).len(), 2);
    send(&router, post_with_headers("b", &[("x-session", "s-1")])).await;
    let warned = events.at("WARN", IGNORED);
    assert_eq!(warned.len(), 3);
    assert_eq!(warned[2]["header"], "x-session");
}

/// The `Authorization` hash, taken by default, says once per layer that a refreshed
/// token is a new scope; chosen on purpose (`scope_with`), it says nothing.
#[tokio::test]
async fn the_authorization_hash_taken_by_default_is_warned_of_once() {
    let (_spans, events, _guard) = recording();
    const HASHED: &str = "hash of its Authorization header";
    let with_token = |key: &str| post_with_headers(key, &[("authorization", "Bearer t-1")]);
    let (router, _) = app(IdempotencyLayer::new(MemoryStore::new()));
    send(&router, with_token("a")).await;
    send(&router, with_token("b")).await;
    let warned = events.at("WARN", HASHED);
    assert_eq!(warned.len(), 1, "{:#?}", events.0.lock().unwrap());
    assert_eq!(warned[0]["route"], "/payments");
    assert!(warned[0]["message"].contains("Principal"), "{warned:?}");
    assert!(!warned[0]["message"].contains("t-1"), "{warned:?}");
    let chosen = IdempotencyLayer::new(MemoryStore::new()).scope_with(Scope::from_authorization);
    let (router, _) = app(chosen);
    send(&router, with_token("a")).await;
    let (router, _) = common::app_behind_auth(IdempotencyLayer::new(MemoryStore::new()));
    send(&router, common::post_as("acct7.first", "a", "{}")).await;
    assert_eq!(events.at("WARN", HASHED).len(), 1);
}

/// A request refused for want of a principal (`require_principal`) is logged at
/// `error`, each time, with its route and the fix.
#[tokio::test]
async fn a_missing_principal_is_logged_at_error_with_its_route() {
    let (_spans, events, _guard) = recording();
    let layer = IdempotencyLayer::new(MemoryStore::new()).require_principal(true);
    let (router, _) = common::app_with_auth_inside(layer);
    for key in ["a", "b"] {
        let refused = send(&router, common::post_as("acct7.first", key, "{}")).await;
        assert_eq!(refused.status, 500);
    }
    let logged = events.at("ERROR", "without a Principal");
    assert_eq!(logged.len(), 2, "{:#?}", events.0.lock().unwrap());
    assert_eq!(logged[0]["route"], "/payments");
    assert!(logged[0]["message"].contains("outside the idempotency layer"));
}
