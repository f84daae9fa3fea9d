//! The app's own errors: the base URI of the problem types, a hook that answers every
//! rejection in the app's format, the rejection types a handler returns, and the
//! extractors' rejections worded as the layer in front of them words its own.

#![allow(clippy::unwrap_used)] // unwrap in test helpers: a failure is the test failing

mod common;

use std::time::Duration;

use axum::{
    Router,
    body::Body,
    http::{Request, StatusCode, header},
    response::IntoResponse,
    routing,
};
use common::{Reply, app, in_flight, post, post_with_headers, send};
use tower_idempotency::{
    IdempotencyKey, IdempotencyLayer, MissingIdempotencyKey, Outcome,
    rejection::{Problem, Rejection},
    store::MemoryStore,
};

const BASE: &str = "https://api.example.com/problems/";

/// The app's error format: `{"error": {"code", "message", "retry_after"}}`.
fn app_format(rejection: &Rejection) -> axum::http::Response<String> {
    let body = serde_json::json!({
        "error": {
            "code": rejection.problem().slug(),
            "message": rejection.detail(),
            "retry_after": rejection.retry_after().map(|after| after.as_secs()),
        }
    });
    axum::http::Response::builder()
        .status(rejection.status())
        .header(header::CONTENT_TYPE, "application/vnd.example.error+json")
        .header(header::CACHE_CONTROL, "no-store")
        .body(body.to_string())
        .unwrap()
}

/// The `type` of a problem+json reply.
fn problem_type(reply: &Reply) -> String {
    assert_eq!(
        reply.header("content-type"),
        Some("application/problem+json"),
        "{:?}",
        reply.body
    );
    reply.json()["type"].as_str().expect("type").to_owned()
}

/// The `error.code` of a reply in [`app_format`].
fn app_code(reply: &Reply) -> String {
    assert_eq!(
        reply.header("content-type"),
        Some("application/vnd.example.error+json"),
        "{:?}",
        reply.body
    );
    reply.json()["error"]["code"]
        .as_str()
        .expect("code")
        .to_owned()
}

fn malformed() -> Request<Body> {
    common::req("POST")
        .header("idempotency-key", "not a structured string")
        .body(Body::from("{}"))
        .unwrap()
}

#[tokio::test]
async fn a_custom_base_names_the_type_of_every_rejection_with_the_same_slugs() {
    let layer = IdempotencyLayer::new(MemoryStore::new()).problem_type_base(BASE);
    let (router, counter) = app(layer);

    let bad = send(&router, malformed()).await;
    assert_eq!(bad.status, 400);
    assert_eq!(problem_type(&bad), format!("{BASE}key-malformed"));
    assert_eq!(bad.outcome, Some(Outcome::Rejected));

    let running = in_flight(
        &router,
        post_with_headers("k", &[("x-held", "1")]),
        &counter,
    )
    .await;
    let busy = send(&router, post("k", "{}")).await;
    assert_eq!(busy.status, 409);
    assert_eq!(problem_type(&busy), format!("{BASE}in-progress"));
    assert_eq!(busy.header("retry-after"), Some("1"));
    assert_eq!(busy.outcome, Some(Outcome::Conflict));
    counter.let_go(1);
    assert_eq!(running.await.unwrap().status, 201);

    let reused = send(&router, post("k", "{\"other\":1}")).await;
    assert_eq!(reused.status, 422);
    assert_eq!(problem_type(&reused), format!("{BASE}key-reused"));
    assert_eq!(reused.outcome, Some(Outcome::Mismatch));
    assert_eq!(counter.runs(), 1);
}

#[tokio::test]
async fn a_rejection_hook_answers_every_rejection_in_the_app_s_format() {
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .problem_type_base(BASE)
        .rejection_with(app_format);
    let (router, counter) = app(layer);

    let bad = send(&router, malformed()).await;
    assert_eq!(bad.status, 400);
    assert_eq!(app_code(&bad), "key-malformed");
    assert_eq!(
        bad.outcome,
        Some(Outcome::Rejected),
        "the outcome stays marked"
    );

    let running = in_flight(
        &router,
        post_with_headers("k", &[("x-held", "1")]),
        &counter,
    )
    .await;
    let res = router.clone().oneshot_reply(post("k", "{}")).await;
    assert_eq!(
        res.extensions().get::<Problem>(),
        Some(&Problem::InProgress),
        "the problem stays marked for middleware outside"
    );
    let busy = Reply::of(res).await;
    assert_eq!(busy.status, 409);
    assert_eq!(app_code(&busy), "in-progress");
    assert_eq!(busy.json()["error"]["retry_after"], 1);
    assert_eq!(busy.outcome, Some(Outcome::Conflict));
    counter.let_go(1);
    assert_eq!(running.await.unwrap().status, 201);

    let reused = send(&router, post("k", "{\"other\":1}")).await;
    assert_eq!(reused.status, 422);
    assert_eq!(app_code(&reused), "key-reused");

    let too_large = IdempotencyLayer::new(MemoryStore::new())
        .request_body_limit(4)
        .rejection_with(app_format);
    let (router, _) = app(too_large);
    let big = send(&router, post("k", "{\"amount\":100}")).await;
    assert_eq!(big.status, 413);
    assert_eq!(app_code(&big), "body-too-large");
}

/// The problem stored when a response cannot be is stored in the app's format, and
/// replayed so: the handler runs once.
#[tokio::test]
async fn a_response_that_cannot_be_stored_is_replayed_in_the_app_s_format() {
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .response_body_limit(8)
        .rejection_with(app_format);
    let (router, counter) = app(layer);
    let first = send(&router, post("k", "{}")).await;
    assert_eq!(
        first.status, 201,
        "the first client gets the response itself"
    );
    let retry = send(&router, post("k", "{}")).await;
    assert_eq!(retry.status, 500);
    assert_eq!(retry.outcome, Some(Outcome::Replayed));
    assert_eq!(app_code(&retry), "response-not-stored");
    assert_eq!(counter.runs(), 1);
}

/// Shutting down answers `503` in the app's format, with its `Retry-After`.
#[tokio::test]
async fn shutting_down_answers_in_the_app_s_format() {
    let layer = IdempotencyLayer::new(MemoryStore::new()).rejection_with(app_format);
    let shutdown = layer.shutdown_handle();
    let (router, counter) = app(layer);
    shutdown.close();
    let refused = send(&router, post("k", "{}")).await;
    assert_eq!(refused.status, 503);
    assert_eq!(app_code(&refused), "shutting-down");
    assert_eq!(refused.json()["error"]["retry_after"], 1);
    assert_eq!(counter.runs(), 0);
}

/// The app's error type, as its handlers return it: an axum response of its own.
enum AppError {
    Idempotency(Rejection),
    /// What the app answers for a reason of its own, with a streamed body.
    Streamed,
}

impl IntoResponse for AppError {
    fn into_response(self) -> axum::response::Response {
        match self {
            AppError::Idempotency(rejection) => {
                let body = axum::Json(serde_json::json!({
                    "error": {
                        "code": rejection.problem().slug(),
                        "message": rejection.detail(),
                        "retry_after": rejection.retry_after().map(|after| after.as_secs()),
                    }
                }));
                let mut res = (
                    rejection.status(),
                    [
                        (header::CONTENT_TYPE, "application/vnd.example.error+json"),
                        (header::CACHE_CONTROL, "no-store"),
                    ],
                    body,
                )
                    .into_response();
                if let Some(after) = rejection.retry_after() {
                    let secs = after.as_secs().max(1);
                    res.headers_mut().insert(header::RETRY_AFTER, secs.into());
                }
                res
            }
            AppError::Streamed => {
                let chunks = futures_util::stream::iter([Ok::<_, std::io::Error>("late")]);
                let pending = futures_util::StreamExt::chain(
                    futures_util::stream::pending::<Result<&str, std::io::Error>>(),
                    chunks,
                );
                (StatusCode::CONFLICT, Body::from_stream(pending)).into_response()
            }
        }
    }
}

/// The app's error type answers every rejection, as `rejection_with` would: those the
/// layer answers, those it stores and replays, the extractors'.
#[tokio::test]
async fn the_app_s_own_error_type_answers_every_rejection() {
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .response_body_limit(8)
        .rejection_into_response(|rejection| AppError::Idempotency(rejection.clone()));
    let (router, counter) = app(layer);

    let bad = send(&router, malformed()).await;
    assert_eq!(
        (bad.status.as_u16(), bad.outcome),
        (400, Some(Outcome::Rejected))
    );
    assert_eq!(app_code(&bad), "key-malformed");

    let running = in_flight(
        &router,
        post_with_headers("k", &[("x-held", "1")]),
        &counter,
    )
    .await;
    let res = router.clone().oneshot_reply(post("k", "{}")).await;
    assert_eq!(
        res.extensions().get::<Problem>(),
        Some(&Problem::InProgress)
    );
    let busy = Reply::of(res).await;
    assert_eq!(busy.status, 409);
    assert_eq!(app_code(&busy), "in-progress");
    assert_eq!(busy.header("retry-after"), Some("1"));
    assert_eq!(busy.header("cache-control"), Some("no-store"));
    counter.let_go(1);
    assert_eq!(running.await.unwrap().status, 201);

    // Stored in the app's format, and replayed so: the handler ran once.
    let retry = send(&router, post("k", "{}")).await;
    assert_eq!(
        (retry.status.as_u16(), retry.outcome),
        (500, Some(Outcome::Replayed))
    );
    assert_eq!(app_code(&retry), "response-not-stored");
    assert_eq!(counter.runs(), 1);

    let keyed = Router::new()
        .route("/payments", routing::post(needs_a_key))
        .layer(
            IdempotencyLayer::new(MemoryStore::new())
                .rejection_into_response(|rejection| AppError::Idempotency(rejection.clone())),
        );
    let unkeyed = common::req("POST").body(Body::from("{}")).unwrap();
    let missing = send(&keyed, unkeyed).await;
    assert_eq!(missing.status, 400);
    assert_eq!(app_code(&missing), "key-missing");
}

/// A body the layer cannot read at once (a stream) is not waited for: the default
/// document answers in its place, under the layer's base.
#[tokio::test]
async fn an_app_error_whose_body_is_not_ready_at_once_is_answered_by_the_default_document() {
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .problem_type_base(BASE)
        .rejection_into_response(|_| AppError::Streamed);
    let (router, counter) = app(layer);
    let bad = send(&router, malformed()).await;
    assert_eq!(
        (bad.status.as_u16(), bad.outcome),
        (400, Some(Outcome::Rejected))
    );
    assert_eq!(problem_type(&bad), format!("{BASE}key-malformed"));
    assert_eq!(counter.runs(), 0);
}

async fn needs_a_key(key: IdempotencyKey) -> String {
    format!("created under {key}")
}

async fn answers_its_own_way(
    key: Result<IdempotencyKey, MissingIdempotencyKey>,
) -> (StatusCode, String) {
    match key {
        Ok(key) => (StatusCode::CREATED, key.to_string()),
        Err(rejection) => {
            // What the rejection says of itself matches what it answers.
            let answered = rejection.clone().into_response();
            assert_eq!(answered.status(), rejection.status());
            let body = axum::body::to_bytes(answered.into_body(), usize::MAX)
                .await
                .unwrap();
            assert_eq!(String::from_utf8_lossy(&body), rejection.body_text());
            let err: &dyn std::error::Error = &rejection;
            (rejection.status(), format!("mine: {err}"))
        }
    }
}

#[tokio::test]
async fn the_extractors_reject_as_the_layer_in_front_words_its_problems() {
    let keyed = Router::new()
        .route("/payments", routing::post(needs_a_key))
        .layer(IdempotencyLayer::new(MemoryStore::new()).rejection_with(app_format));
    let unkeyed = common::req("POST").body(Body::from("{}")).unwrap();
    let missing = send(&keyed, unkeyed).await;
    assert_eq!(missing.status, 400);
    assert_eq!(app_code(&missing), "key-missing");

    let based = Router::new()
        .route("/payments", routing::post(needs_a_key))
        .layer(IdempotencyLayer::new(MemoryStore::new()).problem_type_base(BASE));
    let unkeyed = common::req("POST").body(Body::from("{}")).unwrap();
    let missing = send(&based, unkeyed).await;
    assert_eq!(missing.status, 400);
    assert_eq!(problem_type(&missing), format!("{BASE}key-missing"));

    // No layer: the app's wiring, the default document.
    let bare = Router::new().route("/payments", routing::post(needs_a_key));
    let unguarded = send(&bare, post("k", "{}")).await;
    assert_eq!(unguarded.status, 500);
    assert_eq!(unguarded.problem(), "handler-failed");

    // A handler that takes the rejection answers its own way, and the rejection tells
    // it what it would have answered.
    let own = Router::new()
        .route("/payments", routing::post(answers_its_own_way))
        .layer(IdempotencyLayer::new(MemoryStore::new()).rejection_with(app_format));
    let unkeyed = common::req("POST").body(Body::from("{}")).unwrap();
    let mine = send(&own, unkeyed).await;
    assert_eq!(mine.status, 400);
    assert_eq!(
        String::from_utf8_lossy(&mine.body),
        "mine: Idempotency-Key required: this handler needs an Idempotency-Key, and the request had none"
    );
}

async fn busy_elsewhere() -> Rejection {
    Rejection::new(Problem::InProgress, "the ledger is being reconciled")
        .with_retry_after(Duration::from_millis(2500))
}

async fn reused() -> Problem {
    Problem::KeyReused
}

#[tokio::test]
async fn a_handler_answers_with_the_rejection_types() {
    let router = Router::new()
        .route("/busy", routing::post(busy_elsewhere))
        .route("/reused", routing::post(reused));
    let busy = send(&router, Request::post("/busy").body(Body::empty()).unwrap()).await;
    assert_eq!(busy.status, 409);
    assert_eq!(busy.problem(), "in-progress");
    assert_eq!(busy.header("retry-after"), Some("3"));
    assert_eq!(busy.json()["detail"], "the ledger is being reconciled");
    let reused = send(
        &router,
        Request::post("/reused").body(Body::empty()).unwrap(),
    )
    .await;
    assert_eq!(reused.status, 422);
    assert_eq!(reused.problem(), "key-reused");
}

/// Sends a request and keeps the whole response (its extensions too).
trait OneshotReply {
    async fn oneshot_reply(self, req: Request<Body>) -> axum::response::Response;
}

impl OneshotReply for Router {
    async fn oneshot_reply(self, req: Request<Body>) -> axum::response::Response {
        use tower::ServiceExt;
        self.oneshot(req).await.unwrap()
    }
}

impl Reply {
    async fn of(res: axum::response::Response) -> Reply {
        use http_body_util::BodyExt;
        let outcome = res.extensions().get::<Outcome>().copied();
        let (parts, body) = res.into_parts();
        Reply {
            status: parts.status,
            headers: parts.headers,
            body: body.collect().await.unwrap().to_bytes(),
            outcome,
        }
    }
}
