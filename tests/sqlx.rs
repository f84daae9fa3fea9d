//! The sqlx driver (`SqlxStore`) over the app's own `sqlx::PgPool`: the layer suite in
//! lease mode, and what this driver shares with the tokio-postgres one (the table, its
//! rows, the classification of errors).
#![cfg(feature = "sqlx")]

mod common;

use sqlx::{PgPool, postgres::PgPoolOptions};
use tower_idempotency::store::SqlxStore;

use common::{TestSchema, database_url, pooler_url};

/// A pool of `size` connections to `url`.
async fn pool(url: &str, size: u32) -> PgPool {
    PgPoolOptions::new()
        .max_connections(size)
        .connect(url)
        .await
        .expect("pool")
}

/// A migrated store on a pool of its own in `schema`. With `TI_POOLER_URL` set, its
/// statements go through the transaction pooler, unnamed, and it listens on the
/// database directly, as a deployment behind PgBouncer would.
async fn store(schema: &TestSchema) -> SqlxStore {
    let store = match pooler_url() {
        Some(pooler) => SqlxStore::new(pool(&pooler, 8).await)
            .with_transaction_pooling(true)
            .with_notification_pool(pool(&database_url(), 1).await),
        None => SqlxStore::new(pool(&database_url(), 8).await),
    };
    let store = store.with_schema_name(&schema.name).expect("schema name");
    store.migrate().await.expect("migrate");
    store
}

mod lease {
    use std::sync::Arc;

    use tower_idempotency::store::Store;

    use crate::common::TestSchema;

    async fn make() -> (Arc<dyn Store>, TestSchema) {
        let schema = TestSchema::new();
        (Arc::new(super::store(&schema).await), schema)
    }

    crate::layer_suite!(make);
}
