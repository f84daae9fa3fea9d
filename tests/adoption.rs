//! The crate as an app adopts it, through its public paths only: the app's own pool,
//! built with the `deadpool_postgres` and `tokio_postgres` the crate re-exports; a
//! repository written against `deadpool_postgres::GenericClient`, called with the
//! request's transaction; an axum 0.8 router with lease mode on one route and
//! transactional mode on the other, migrated and shut down with no store object of
//! its own; its problem types under its own base URI on one, its own error format on
//! the other, and handlers that answer with the crate's rejection types. It has to
//! compile as written, and it serves: one request through each route, over HTTP,
//! against the real database, and its replay; and a rejection from each.

#![allow(clippy::unwrap_used)] // unwrap in the test itself: a failure is the test failing

mod common;

/// The app, as its authors would write it.
mod app {
    use std::sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    };

    use axum::{
        Router,
        extract::State,
        http::{Response, StatusCode, header},
        response::IntoResponse,
        routing::post,
    };
    use tower_idempotency::{
        IdempotencyKey, IdempotencyLayer, MissingIdempotencyKey, ShutdownHandle,
        deadpool_postgres::{self, GenericClient},
        rejection::Rejection,
        store::StoreError,
        tokio_postgres::{self, NoTls},
        transactional::TransactionHandle,
    };

    pub(crate) fn pool(
        url: &str,
    ) -> Result<deadpool_postgres::Pool, deadpool_postgres::CreatePoolError> {
        let mut config = deadpool_postgres::Config::new();
        config.url = Some(url.to_owned());
        config.create_pool(Some(deadpool_postgres::Runtime::Tokio1), NoTls)
    }

    /// The app's own schema.
    pub(crate) async fn migrate(
        pool: &deadpool_postgres::Pool,
    ) -> Result<(), Box<dyn std::error::Error>> {
        pool.get()
            .await?
            .batch_execute(
                "CREATE TABLE IF NOT EXISTS charges (
                     id bigserial PRIMARY KEY,
                     payment text NOT NULL UNIQUE,
                     amount bigint NOT NULL
                 )",
            )
            .await?;
        Ok(())
    }

    /// The app's repository: the same code on a pooled client or in any transaction.
    pub(crate) async fn charge(
        db: &impl GenericClient,
        payment: &str,
        amount: i64,
    ) -> Result<i64, tokio_postgres::Error> {
        let insert = db
            .prepare_cached("INSERT INTO charges (payment, amount) VALUES ($1, $2) RETURNING id")
            .await?;
        Ok(db.query_one(&insert, &[&payment, &amount]).await?.get(0))
    }

    fn failed(e: impl std::fmt::Display) -> axum::response::Response {
        (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response()
    }

    /// Transactional mode: the charge commits with the stored response, or not at all.
    async fn create_charge(
        key: IdempotencyKey,
        tx: TransactionHandle,
        amount: String,
    ) -> Result<(StatusCode, String), axum::response::Response> {
        let amount: i64 = amount.parse().map_err(|_| {
            (StatusCode::UNPROCESSABLE_ENTITY, "an amount".to_owned()).into_response()
        })?;
        // The crate's own rejection, as the answer of a closed transaction.
        let client = tx.client().await.map_err(IntoResponse::into_response)?;
        let id = charge(client.as_deadpool(), &key.derive("charge"), amount)
            .await
            .map_err(failed)?;
        Ok((StatusCode::CREATED, format!("charge {id}: {amount}")))
    }

    /// Receipts sent, by the app's mailer (outside the database).
    #[derive(Clone, Default)]
    pub(crate) struct Mailer(pub(crate) Arc<AtomicUsize>);

    /// Lease mode: the mailer is called with a key of its own, derived from the client's;
    /// a request without one gets the extractor's rejection, in the app's format.
    async fn send_receipt(
        key: Result<IdempotencyKey, MissingIdempotencyKey>,
        State(mailer): State<Mailer>,
    ) -> Result<(StatusCode, String), MissingIdempotencyKey> {
        let key = key?;
        let sent = mailer.0.fetch_add(1, Ordering::SeqCst) + 1;
        Ok((
            StatusCode::ACCEPTED,
            format!("receipt {sent} ({})", key.derive("mailer")),
        ))
    }

    /// The app's error format: `{"error": {"code", "message"}}`.
    pub(crate) fn app_error(rejection: &Rejection) -> Response<String> {
        let body = serde_json::json!({
            "error": { "code": rejection.problem().slug(), "message": rejection.detail() }
        });
        let mut res = Response::builder()
            .status(rejection.status())
            .header(header::CONTENT_TYPE, "application/json")
            .header(header::CACHE_CONTROL, "no-store");
        if let Some(after) = rejection.retry_after() {
            res = res.header(header::RETRY_AFTER, after.as_secs().max(1));
        }
        res.body(body.to_string()).expect("a response")
    }

    /// Where the app documents its errors.
    pub(crate) const PROBLEMS: &str = "https://api.example.com/problems/";

    /// The app's router: the idempotency store set up from the pool alone, and both
    /// layers shut down by `shutdown`.
    pub(crate) async fn router(
        pool: deadpool_postgres::Pool,
        mailer: Mailer,
        shutdown: ShutdownHandle,
    ) -> Result<Router, StoreError> {
        let transactional = IdempotencyLayer::transactional(pool.clone())
            .require_key(true)
            .problem_type_base(PROBLEMS)
            .shutdown_with(shutdown.clone());
        let leased = IdempotencyLayer::new(pool)
            .rejection_with(app_error)
            .shutdown_with(shutdown);
        transactional.migrate().await?;
        Ok(Router::new()
            .route("/charges", post(create_charge).route_layer(transactional))
            .route("/receipts", post(send_receipt).route_layer(leased))
            .with_state(mailer))
    }
}

use std::sync::atomic::Ordering;

use axum::body::Body;
use http_body_util::BodyExt;
use hyper::{Request, StatusCode};
use hyper_util::{client::legacy::Client, rt::TokioExecutor};
use tokio_util::sync::CancellationToken;
use tower_idempotency::{IDEMPOTENT_REPLAYED, ShutdownHandle};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_app_on_its_own_pool_serves_both_modes_and_replays_each() {
    let db = common::TestDatabase::new().await;
    let pool = app::pool(&db.url()).unwrap();
    app::migrate(&pool).await.unwrap();
    let mailer = app::Mailer::default();
    let cancel = CancellationToken::new();
    let shutdown = ShutdownHandle::closed_by(&cancel);
    let router = app::router(pool.clone(), mailer.clone(), shutdown.clone())
        .await
        .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(
        axum::serve(listener, router)
            .with_graceful_shutdown(cancel.clone().cancelled_owned())
            .into_future(),
    );

    let client = Client::builder(TokioExecutor::new()).build_http();
    let post = |path: &str, key: &str, body: &str| {
        let req = Request::post(format!("http://{addr}{path}"))
            .header("idempotency-key", key)
            .body(Body::from(body.to_owned()))
            .unwrap();
        let client = client.clone();
        async move {
            let res = client.request(req).await.unwrap();
            let replayed = res.headers().get(IDEMPOTENT_REPLAYED).cloned();
            let status = res.status();
            let body = res.into_body().collect().await.unwrap().to_bytes();
            (status, replayed, body)
        }
    };

    for (path, key, body, status) in [
        ("/charges", "charge-1", "1250", StatusCode::CREATED),
        ("/receipts", "receipt-1", "", StatusCode::ACCEPTED),
    ] {
        let (first, replayed, answer) = post(path, key, body).await;
        assert_eq!(first, status, "{path}: {answer:?}");
        assert_eq!(replayed, None, "{path}");
        let (again, replayed, replay) = post(path, key, body).await;
        assert_eq!(again, status, "{path}");
        assert_eq!(replayed.as_ref().map(|v| v.as_bytes()), Some(&b"true"[..]));
        assert_eq!(replay, answer, "{path}: the stored answer, byte for byte");
    }
    // Rejections in the app's words: a malformed key under its problem base URI, and
    // a receipt without a key in its own error format, from the handler's extractor.
    let (status, _, body) = post("/charges", "a key with spaces", "1").await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let problem: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(
        problem["type"],
        format!("{}key-malformed", app::PROBLEMS),
        "{problem}"
    );
    let unkeyed = Request::post(format!("http://{addr}/receipts"))
        .body(Body::empty())
        .unwrap();
    let res = client.request(unkeyed).await.unwrap();
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
    let body = res.into_body().collect().await.unwrap().to_bytes();
    let error: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(error["error"]["code"], "key-missing", "{error}");

    // Each ran once: one charge, written in its request's transaction; one receipt.
    let charges = pool
        .get()
        .await
        .unwrap()
        .query_one("SELECT count(*) FROM charges", &[])
        .await
        .unwrap()
        .get::<_, i64>(0);
    assert_eq!(charges, 1);
    assert_eq!(mailer.0.load(Ordering::SeqCst), 1);

    // The app's shutdown: one token stops the server and both layers, one drain waits.
    cancel.cancel();
    shutdown.drain().await;
    server.await.unwrap().unwrap();
    drop(pool);
    drop(db);
}
