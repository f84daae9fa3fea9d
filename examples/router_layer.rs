//! `IdempotencyLayer` on a whole Axum router.
//!
//! ```text
//! cargo run --example router_layer -- [--addr 127.0.0.1:3000]
//! ```
//!
//! Every route of the router sits behind the layer. Requests on the guarded methods
//! (POST and PATCH by default) that carry an `Idempotency-Key` are claimed, run once,
//! stored and replayed; everything else (here `GET /health`) passes straight through.
//!
//! The store is in memory, unless `DATABASE_URL` is set: then it is PostgreSQL (the
//! table `public.idempotency_keys`, created on start), shared by every process that
//! points at the same database.

use std::{
    error::Error,
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
};

use axum::{
    Json, Router,
    extract::State,
    http::StatusCode,
    response::IntoResponse,
    routing::{get, post},
};
use serde_json::json;
use tower_idempotency::{
    IdempotencyKey, IdempotencyLayer,
    store::{MemoryStore, Store},
};

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    let addr = parse_addr()?;
    let store = store().await?;

    let app = Router::new()
        .route("/orders", post(create_order))
        .route("/health", get(|| async { "ok" }))
        .with_state(Orders::default())
        // One layer for the whole router. The key stays optional at the layer: a POST
        // without one passes through, and it is the handler's `IdempotencyKey`
        // extractor that answers 400. Use `.require_key(true)` to reject such requests
        // in the layer for every route at once.
        .layer(IdempotencyLayer::new(store));

    let listener = tokio::net::TcpListener::bind(addr).await?;
    let addr = listener.local_addr()?;
    println!("listening on http://{addr}");
    println!(
        "send this twice; the second answer is the stored one, with `idempotent-replayed: true`:"
    );
    println!("  curl -i http://{addr}/orders -H 'Idempotency-Key: order-1' -d 'two coffees'");
    println!("the same key with another body is refused with 422:");
    println!("  curl -i http://{addr}/orders -H 'Idempotency-Key: order-1' -d 'three coffees'");
    axum::serve(listener, app).await?;
    Ok(())
}

/// The app's state: a counter standing in for a database of orders.
#[derive(Clone, Default)]
struct Orders {
    last_id: Arc<AtomicU64>,
}

/// Creates an order. Behind the layer it runs once per key: a retry gets the stored
/// response (the same order id) instead of a second order.
async fn create_order(
    State(orders): State<Orders>,
    // Put in the request by the layer; rejects with 400 when the request had no key.
    key: IdempotencyKey,
    item: String,
) -> impl IntoResponse {
    let id = orders.last_id.fetch_add(1, Ordering::Relaxed) + 1;
    let order = json!({ "order_id": id, "item": item, "idempotency_key": key.as_str() });
    (StatusCode::CREATED, Json(order))
}

/// The store: PostgreSQL when `DATABASE_URL` is set, otherwise in memory.
async fn store() -> Result<Arc<dyn Store>, Box<dyn Error>> {
    #[cfg(feature = "postgres")]
    if let Some(url) = std::env::var("DATABASE_URL").ok().filter(|u| !u.is_empty()) {
        let store = tower_idempotency::store::PostgresStore::connect(&url)?;
        // Creates the table if needed; safe to run from every replica at start-up.
        store.migrate().await?;
        println!("store: postgres, table {}", store.table());
        return Ok(Arc::new(store));
    }
    println!("store: memory (set DATABASE_URL to use PostgreSQL)");
    Ok(Arc::new(MemoryStore::new()))
}

/// The address from `--addr HOST:PORT`, by default 127.0.0.1:3000.
fn parse_addr() -> Result<SocketAddr, Box<dyn Error>> {
    let mut addr = SocketAddr::from(([127, 0, 0, 1], 3000));
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--addr" => addr = args.next().ok_or("--addr needs a value")?.parse()?,
            other => {
                return Err(format!(
                    "unknown argument {other:?}; usage: router_layer [--addr HOST:PORT]"
                )
                .into());
            }
        }
    }
    Ok(addr)
}
