//! The layer suite, against each store.

mod common;

mod memory {
    use std::sync::Arc;

    use tower_idempotency::store::{MemoryStore, Store};

    async fn make() -> (Arc<dyn Store>, ()) {
        (Arc::new(MemoryStore::new()), ())
    }

    crate::layer_suite!(make);
}

mod postgres {
    use std::sync::Arc;

    use tower_idempotency::store::Store;

    use crate::common::TestSchema;

    async fn make() -> (Arc<dyn Store>, TestSchema) {
        let schema = TestSchema::new();
        let store = schema.store().await;
        (Arc::new(store), schema)
    }

    crate::layer_suite!(make);
}
