//! `IdempotencyLayer` on one Axum route only.
//!
//! ```text
//! cargo run --example route_layer -- [--addr 127.0.0.1:3000]
//! ```
//!
//! `POST /transfers` is guarded with `.route_layer(...)` and requires a key;
//! `POST /notes` on the same router is not guarded at all: it runs on every request,
//! with or without a key.
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

use axum::{Json, Router, extract::State, http::StatusCode, response::IntoResponse, routing::post};
use serde_json::json;
use tower_idempotency::{
    IdempotencyKey, IdempotencyLayer,
    store::{MemoryStore, Store},
};

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    let addr = parse_addr()?;

    // A transfer must never run twice, so this route refuses requests without a key
    // (400, in the layer, before the handler runs).
    let layer = IdempotencyLayer::new(store().await?).require_key(true);

    let app = Router::new()
        // `route_layer` wraps this route's handler only, after routing: requests to
        // other paths never reach the layer.
        .route("/transfers", post(create_transfer).route_layer(layer))
        .route("/notes", post(create_note))
        .with_state(Counters::default());

    let listener = tokio::net::TcpListener::bind(addr).await?;
    let addr = listener.local_addr()?;
    println!("listening on http://{addr}");
    println!(
        "guarded: send this twice; the second answer is replayed (`idempotent-replayed: true`):"
    );
    println!(
        "  curl -i http://{addr}/transfers -H 'Idempotency-Key: transfer-1' -d '100 EUR to Bob'"
    );
    println!("guarded: without a key it is refused with 400:");
    println!("  curl -i http://{addr}/transfers -d '100 EUR to Bob'");
    println!("unguarded: every request runs, key or not:");
    println!("  curl -i http://{addr}/notes -H 'Idempotency-Key: note-1' -d 'hello'");
    axum::serve(listener, app).await?;
    Ok(())
}

/// The app's state: counters standing in for a database.
#[derive(Clone, Default)]
struct Counters {
    transfers: Arc<AtomicU64>,
    notes: Arc<AtomicU64>,
}

/// Guarded: runs once per key; retries get the stored response.
async fn create_transfer(
    State(c): State<Counters>,
    key: IdempotencyKey,
    what: String,
) -> impl IntoResponse {
    let id = c.transfers.fetch_add(1, Ordering::Relaxed) + 1;
    // `derive` gives a stable key for a downstream call (a bank, a payment provider),
    // so that a retry of this request cannot repeat that call either.
    let bank_key = key.derive("bank");
    let transfer = json!({ "transfer_id": id, "what": what, "bank_idempotency_key": bank_key });
    (StatusCode::CREATED, Json(transfer))
}

/// Not guarded: a new note on every request.
async fn create_note(State(c): State<Counters>, text: String) -> impl IntoResponse {
    let id = c.notes.fetch_add(1, Ordering::Relaxed) + 1;
    (
        StatusCode::CREATED,
        Json(json!({ "note_id": id, "text": text })),
    )
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
                    "unknown argument {other:?}; usage: route_layer [--addr HOST:PORT]"
                )
                .into());
            }
        }
    }
    Ok(addr)
}
