//! The layer's metrics (feature `metrics`), exported in the Prometheus text format.
//!
//! ```text
//! cargo run -p example-metrics-exporter
//! ```
//!
//! Installs metrics-exporter-prometheus's recorder, sends a few requests through the
//! layer on the in-memory store (a new key, its retry, a duplicate while the first
//! still runs, the key reused with another body, a request without a key, a `500` that
//! releases its key), then prints what a scrape would read:
//! `idempotency_requests_total` by outcome, method, route and status, the claim and
//! completion histograms. Prometheus spells the labels with `_` for `.`
//! (`idempotency_outcome`, `http_route`). Each request's outcome event goes to stderr meanwhile, as the
//! plain `fmt` subscriber prints it. In a service, serve `handle.render()` at
//! `/metrics` (or enable the exporter's `http-listener` feature).

use std::sync::Arc;

use axum::{
    Router,
    body::Body,
    http::{Request, StatusCode},
    routing::post,
};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
use tokio::sync::Semaphore;
use tower::ServiceExt;
use tower_idempotency::{IdempotencyLayer, store::MemoryStore};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,tower_idempotency=debug".into()),
        )
        .init();
    // Histograms as Prometheus histograms with these buckets (seconds), rather than the
    // exporter's default summaries.
    let buckets = [0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0];
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &buckets)?
        .install_recorder()?;
    tower_idempotency::metrics::describe();

    // A handler that, for a body of "hold", says it started and waits until let go: a
    // request still running; for a body of "fail", answers 500.
    let (started, gate) = (Arc::new(Semaphore::new(0)), Arc::new(Semaphore::new(0)));
    let (starts, held) = (started.clone(), gate.clone());
    let app = Router::new()
        .route(
            "/orders",
            post(move |body: String| {
                let (starts, held) = (starts.clone(), held.clone());
                async move {
                    if body == "hold" {
                        starts.add_permits(1);
                        let _ = held.acquire().await.map(|p| p.forget());
                    }
                    if body == "fail" {
                        return (StatusCode::INTERNAL_SERVER_ERROR, "the warehouse is down\n");
                    }
                    (StatusCode::CREATED, "order created\n")
                }
            }),
        )
        .layer(IdempotencyLayer::new(MemoryStore::new()).require_key(true));

    let send = |key: Option<&str>, body: &str| {
        let mut request = Request::post("/orders");
        if let Some(key) = key {
            request = request.header("idempotency-key", key);
        }
        let request = request.body(Body::from(body.to_owned()));
        let app = app.clone();
        async move {
            let answer = app.oneshot(request?).await?;
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>(answer.status())
        }
    };

    send(Some("order-1"), "{}").await?; // executed
    send(Some("order-1"), "{}").await?; // replayed
    // A duplicate while the first request with its key still runs: 409.
    let first = tokio::spawn(send(Some("order-2"), "hold"));
    started.acquire().await?.forget();
    send(Some("order-2"), "hold").await?; // conflict: 409
    gate.add_permits(1);
    first.await??;
    send(Some("order-1"), "{\"amount\": 2}").await?; // mismatch: 422
    send(None, "{}").await?; // rejected: key-missing, 400
    send(Some("order-3"), "fail").await?; // released: 500, its key freed for a retry

    print!("{}", handle.render());
    Ok(())
}
