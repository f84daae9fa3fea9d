//! Counting what the idempotency layer does, from the `Outcome` it puts in every
//! response's extensions.
//!
//! ```text
//! cargo run --example outcome_metrics
//! curl -s -XPOST localhost:3000/orders -H 'Idempotency-Key: k1' -d '{}'
//! curl -s -XPOST localhost:3000/orders -H 'Idempotency-Key: k1' -d '{}'   # replayed
//! curl -s localhost:3000/metrics
//! ```
//!
//! `/metrics` answers in the Prometheus text format:
//! `idempotency_requests_total{outcome="replayed"} 1`. The same outcome is also the
//! `outcome` field of the `idempotency` tracing span, which this example logs as each
//! request's span closes.

use std::{
    collections::BTreeMap,
    net::SocketAddr,
    sync::{Arc, Mutex},
};

use axum::{
    Router,
    extract::{Request, State},
    middleware::{self, Next},
    response::Response,
    routing::{get, post},
};
use tower_idempotency::{IdempotencyLayer, Outcome, store::MemoryStore};

/// Requests per outcome.
#[derive(Clone, Default)]
struct Counts(Arc<Mutex<BTreeMap<&'static str, u64>>>);

/// Outside the idempotency layer: sees every response it produced, and its outcome.
async fn count_outcomes(State(counts): State<Counts>, request: Request, next: Next) -> Response {
    let response = next.run(request).await;
    if let Some(outcome) = response.extensions().get::<Outcome>()
        && let Ok(mut counts) = counts.0.lock()
    {
        *counts.entry(outcome.as_str()).or_default() += 1;
    }
    response
}

async fn metrics(State(counts): State<Counts>) -> String {
    let counts = counts.0.lock().map(|c| c.clone()).unwrap_or_default();
    let mut out = String::from(
        "# HELP idempotency_requests_total Requests seen by the idempotency layer, by outcome.\n\
         # TYPE idempotency_requests_total counter\n",
    );
    for (outcome, n) in counts {
        out.push_str(&format!(
            "idempotency_requests_total{{outcome=\"{outcome}\"}} {n}\n"
        ));
    }
    out
}

async fn create_order() -> &'static str {
    "order created\n"
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Each request's `idempotency` span is logged when it closes, with its `outcome`.
    tracing_subscriber::fmt()
        .with_span_events(tracing_subscriber::fmt::format::FmtSpan::CLOSE)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let addr: SocketAddr = match std::env::args().skip_while(|a| a != "--addr").nth(1) {
        Some(addr) => addr.parse()?,
        None => SocketAddr::from(([127, 0, 0, 1], 3000)),
    };
    let counts = Counts::default();
    let app = Router::new()
        .route("/orders", post(create_order))
        .layer(IdempotencyLayer::new(MemoryStore::new()))
        .layer(middleware::from_fn_with_state(
            counts.clone(),
            count_outcomes,
        ))
        .route("/metrics", get(metrics))
        .with_state(counts);
    let listener = tokio::net::TcpListener::bind(addr).await?;
    println!(
        "listening on http://{}; counts at /metrics",
        listener.local_addr()?
    );
    axum::serve(listener, app).await?;
    Ok(())
}
