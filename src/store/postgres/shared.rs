//! Connections shared by concurrent claims, which tokio-postgres pipelines.
//!
//! A claim is one autocommit statement on the primary key, and for a key that exists
//! (a replay, a 409, a 422) a read. It needs no connection of its own: concurrent
//! claims are written to a shared connection back to back, each with its own `Sync`,
//! so each still commits (or fails) alone, and PostgreSQL reads and answers them in
//! batches instead of waking once per statement.
//!
//! What a shared connection must not do is let one claim hold up the others queued
//! behind it. Each runs with a short `lock_timeout`: a claim that would wait on a row
//! lock (held by a transactional claim, a purge, or the app's own transaction) fails
//! fast, having changed nothing, and the store runs it again on a pooled connection of
//! its own, where it may wait. A connection that closes is replaced on its next use.
//! Statements that always write (completions, releases, renewals) stay on pooled
//! connections, where their commits overlap.

use std::{
    sync::{
        Arc, Mutex, PoisonError,
        atomic::{AtomicU64, AtomicUsize, Ordering},
    },
    time::Duration,
};

use deadpool_postgres::{ClientWrapper, Object, Pool};

use super::{classify, classify_pool};
use crate::store::StoreError;

/// The `lock_timeout` of a shared connection: how long one claim may hold up the
/// claims queued behind it before it moves to a connection of its own.
pub(super) const LOCK_TIMEOUT: Duration = Duration::from_millis(50);

/// `n` connections, taken from the pool when first used and kept; claims are dealt to
/// them in turn.
pub(super) struct Shared {
    slots: Box<[Slot]>,
    next: AtomicUsize,
    /// Claims dealt to a shared connection, and those of them moved off it.
    claims: AtomicU64,
    moved: AtomicU64,
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

/// A shared connection, and the slot it was dealt from.
pub(super) struct SharedClient {
    index: usize,
    client: Arc<ClientWrapper>,
}

impl std::ops::Deref for SharedClient {
    type Target = ClientWrapper;

    fn deref(&self) -> &ClientWrapper {
        &self.client
    }
}

impl Shared {
    pub(super) fn new(n: usize) -> Self {
        Self {
            slots: (0..n).map(|_| Slot::default()).collect(),
            next: AtomicUsize::new(0),
            claims: AtomicU64::new(0),
            moved: AtomicU64::new(0),
        }
    }

    /// The next connection in turn, opened (or reopened) from `pool` if need be.
    pub(super) async fn get(&self, pool: &Pool) -> Result<SharedClient, StoreError> {
        self.claims.fetch_add(1, Ordering::Relaxed);
        let index = self.next.fetch_add(1, Ordering::Relaxed) % self.slots.len();
        let slot = &self.slots[index];
        let shared = |client| SharedClient { index, client };
        if let Some(client) = slot.open() {
            return Ok(shared(client));
        }
        let _connecting = slot.connecting.lock().await;
        if let Some(client) = slot.open() {
            return Ok(shared(client));
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
        Ok(shared(client))
    }

    /// Forgets `client` after it failed as unavailable: the next claim dealt to its slot
    /// opens a new connection rather than finding out again. (A connection that the
    /// server ended reports it closed only once its task has seen the end.)
    pub(super) fn evict(&self, client: &SharedClient) {
        let mut current = self.slots[client.index]
            .current
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if current
            .as_ref()
            .is_some_and(|c| Arc::ptr_eq(c, &client.client))
        {
            *current = None;
        }
    }

    /// How many connections are shared.
    pub(super) fn len(&self) -> usize {
        self.slots.len()
    }

    /// Records a claim that met a row lock and moves to a pooled connection.
    pub(super) fn moved_off(&self) {
        self.moved.fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn claims(&self) -> u64 {
        self.claims.load(Ordering::Relaxed)
    }

    pub(super) fn moved(&self) -> u64 {
        self.moved.load(Ordering::Relaxed)
    }
}
