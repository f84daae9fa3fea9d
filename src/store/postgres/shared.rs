//! Connections shared by concurrent single statements, which tokio-postgres pipelines.
//!
//! A statement of lease mode is one autocommit statement on the primary key. It needs
//! no connection of its own: concurrent ones are written to a shared connection back to
//! back, each with its own `Sync`, so each still commits (or fails) alone, and
//! PostgreSQL reads and answers them in batches instead of one wake-up per statement.
//!
//! What a shared connection must not do is let one statement hold up the others queued
//! behind it. Each runs with a short `lock_timeout`: a statement that would wait on a
//! row lock (held by a transactional claim, a purge, or the app's own transaction) fails
//! fast, having changed nothing, and the store runs it again on a pooled connection of
//! its own, where it may wait. A connection that closes is replaced on its next use.

use std::{
    sync::{
        Arc, Mutex, PoisonError,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use deadpool_postgres::{ClientWrapper, Object, Pool};

use super::{classify, classify_pool};
use crate::store::StoreError;

/// The `lock_timeout` of a shared connection: how long one statement may hold up the
/// statements queued behind it before it moves to a connection of its own.
pub(super) const LOCK_TIMEOUT: Duration = Duration::from_millis(50);

/// `n` connections, taken from the pool when first used and kept; statements are dealt
/// to them in turn.
pub(super) struct Shared {
    slots: Box<[Slot]>,
    next: AtomicUsize,
}

#[derive(Default)]
struct Slot {
    current: Mutex<Option<Arc<ClientWrapper>>>,
    /// Held while the slot connects, so that a burst of statements opens one connection.
    connecting: tokio::sync::Mutex<()>,
}

impl Slot {
    /// The slot's connection, unless it has closed (then the slot is emptied).
    fn open(&self) -> Option<Arc<ClientWrapper>> {
        let mut current = self.current.lock().unwrap_or_else(PoisonError::into_inner);
        match &*current {
            Some(client) if !client.is_closed() => Some(client.clone()),
            Some(_) => {
                *current = None;
                None
            }
            None => None,
        }
    }
}

impl Shared {
    pub(super) fn new(n: usize) -> Self {
        Self {
            slots: (0..n).map(|_| Slot::default()).collect(),
            next: AtomicUsize::new(0),
        }
    }

    /// The next connection in turn, opened (or reopened) from `pool` if need be.
    pub(super) async fn get(&self, pool: &Pool) -> Result<Arc<ClientWrapper>, StoreError> {
        let slot = &self.slots[self.next.fetch_add(1, Ordering::Relaxed) % self.slots.len()];
        if let Some(client) = slot.open() {
            return Ok(client);
        }
        let _connecting = slot.connecting.lock().await;
        if let Some(client) = slot.open() {
            return Ok(client);
        }
        // Taken out of the pool for good: the pool may open another in its place, and
        // this one, with its own settings, never goes back to serve a transaction.
        let client = Object::take(pool.get().await.map_err(classify_pool)?);
        client
            .batch_execute(&format!(
                "SET lock_timeout = '{}ms'",
                LOCK_TIMEOUT.as_millis()
            ))
            .await
            .map_err(classify)?;
        let client = Arc::new(client);
        *slot.current.lock().unwrap_or_else(PoisonError::into_inner) = Some(client.clone());
        Ok(client)
    }

    /// How many connections are shared.
    pub(super) fn len(&self) -> usize {
        self.slots.len()
    }
}
