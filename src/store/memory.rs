//! A store in this process's memory.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, MutexGuard, PoisonError},
    time::{Duration, Instant},
};

use super::{BoxFuture, Claim, ClaimRequest, Lease, Store, StoreError};
use crate::{Fingerprint, Scope, StoredResponse};

/// An in-memory [`Store`] for one process: examples, demos and tests of layer logic.
///
/// Claims are atomic within the process. Nothing survives a restart and nothing is
/// shared between replicas: use [`PostgresStore`](super::PostgresStore) for that.
/// Expired records are swept as new keys arrive, so memory is bounded by the keys of one
/// TTL window.
///
/// ```
/// use tower_idempotency::{IdempotencyLayer, store::MemoryStore};
///
/// let layer = IdempotencyLayer::new(MemoryStore::new());
/// ```
#[derive(Clone)]
pub struct MemoryStore {
    inner: Arc<Mutex<Inner>>,
    /// Completed and released keys, for requests waiting on them.
    changes: tokio::sync::broadcast::Sender<Arc<(Scope, Arc<str>)>>,
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self {
            inner: Arc::default(),
            changes: tokio::sync::broadcast::channel(1024).0,
        }
    }
}

#[derive(Default)]
struct Inner {
    records: HashMap<(Scope, Arc<str>), Record>,
    last_sweep: Option<Instant>,
}

struct Record {
    fingerprint: Fingerprint,
    token: i64,
    expires_at: Instant,
    state: State,
}

enum State {
    Running { locked_until: Instant },
    Completed(StoredResponse),
}

impl Record {
    /// Past its TTL and not held by a live lease: it may be purged or claimed afresh.
    fn is_free(&self, now: Instant) -> bool {
        self.expires_at <= now
            && match self.state {
                State::Completed(_) => true,
                State::Running { locked_until } => locked_until <= now,
            }
    }
}

/// `now + d`, saturating far in the future instead of overflowing.
fn later(now: Instant, d: Duration) -> Instant {
    now.checked_add(d)
        .unwrap_or_else(|| now + Duration::from_secs(100 * 365 * 24 * 3600))
}

impl std::fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStore")
            .field("records", &self.len())
            .finish()
    }
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// The number of records held, expired ones included until swept.
    pub fn len(&self) -> usize {
        self.lock().records.len()
    }

    /// Whether the store holds no records.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Removes expired records now; returns how many.
    pub fn purge_expired(&self) -> usize {
        let mut inner = self.lock();
        let before = inner.records.len();
        let now = Instant::now();
        inner.records.retain(|_, r| !r.is_free(now));
        before - inner.records.len()
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // No code path panics while holding the lock, but a poisoned map is still
        // consistent: every mutation is a single insert, update or remove.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn claim_now(&self, req: &ClaimRequest<'_>) -> Claim {
        let now = Instant::now();
        let mut inner = self.lock();
        // Sweep expired records at most once a second: a full pass costs O(records).
        if inner
            .last_sweep
            .is_none_or(|last| now.duration_since(last) >= Duration::from_secs(1))
        {
            inner.last_sweep = Some(now);
            inner.records.retain(|_, r| !r.is_free(now));
        }
        let id = (req.scope.clone(), Arc::<str>::from(req.key));
        let new_record = |token| Record {
            fingerprint: req.fingerprint,
            token,
            expires_at: later(now, req.ttl),
            state: State::Running {
                locked_until: later(now, req.lease),
            },
        };
        let lease = |token| Lease {
            scope: req.scope.clone(),
            key: id.1.clone(),
            token,
        };
        let Some(record) = inner.records.get_mut(&id) else {
            let token = super::fresh_token();
            inner.records.insert(id.clone(), new_record(token));
            return Claim::Acquired(lease(token));
        };
        let expired = record.is_free(now);
        match &record.state {
            _ if expired => {}
            State::Running { locked_until }
                if *locked_until <= now && record.fingerprint == req.fingerprint => {}
            State::Running { locked_until } => {
                return Claim::Running {
                    fingerprint: record.fingerprint,
                    retry_after: locked_until.saturating_duration_since(now),
                };
            }
            State::Completed(response) => {
                return Claim::Completed {
                    fingerprint: record.fingerprint,
                    response: response.clone(),
                };
            }
        }
        let token = record.token + 1;
        *record = new_record(token);
        Claim::Acquired(lease(token))
    }

    /// Runs `f` on the running record held by `lease`; `false` when the lease is lost.
    fn with_held(&self, lease: &Lease, f: impl FnOnce(&mut Inner, (Scope, Arc<str>))) -> bool {
        let mut inner = self.lock();
        let id = (lease.scope.clone(), lease.key.clone());
        let held = matches!(
            inner.records.get(&id),
            Some(r) if r.token == lease.token && matches!(r.state, State::Running { .. })
        );
        if held {
            f(&mut inner, id);
        }
        held
    }

    fn announce(&self, lease: &Lease) {
        // No receivers is fine: nobody is waiting.
        let _ = self
            .changes
            .send(Arc::new((lease.scope.clone(), lease.key.clone())));
    }
}

impl Store for MemoryStore {
    fn claim<'a>(
        &'a self,
        request: &'a ClaimRequest<'a>,
    ) -> BoxFuture<'a, Result<Claim, StoreError>> {
        Box::pin(async move { Ok(self.claim_now(request)) })
    }

    fn complete<'a>(
        &'a self,
        lease: &'a Lease,
        response: &'a StoredResponse,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(async move {
            let done = self.with_held(lease, |inner, id| {
                if let Some(r) = inner.records.get_mut(&id) {
                    r.state = State::Completed(response.clone());
                    r.expires_at = later(Instant::now(), ttl);
                }
            });
            if done {
                self.announce(lease);
            }
            Ok(done)
        })
    }

    fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(async move {
            let done = self.with_held(lease, |inner, id| {
                inner.records.remove(&id);
            });
            if done {
                self.announce(lease);
            }
            Ok(done)
        })
    }

    fn renew<'a>(
        &'a self,
        lease: &'a Lease,
        duration: Duration,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(async move {
            Ok(self.with_held(lease, |inner, id| {
                if let Some(r) = inner.records.get_mut(&id) {
                    let until = later(Instant::now(), duration);
                    r.state = State::Running {
                        locked_until: until,
                    };
                    // A live holder's record outlives its TTL.
                    r.expires_at = r.expires_at.max(until);
                }
            }))
        })
    }

    fn purge<'a>(&'a self, batch: usize) -> BoxFuture<'a, Result<u64, StoreError>> {
        Box::pin(async move {
            let now = Instant::now();
            let mut inner = self.lock();
            let expired: Vec<_> = inner
                .records
                .iter()
                .filter(|(_, r)| r.is_free(now))
                .map(|(id, _)| id.clone())
                .take(batch)
                .collect();
            for id in &expired {
                inner.records.remove(id);
            }
            Ok(expired.len() as u64)
        })
    }

    fn changed(&self, scope: &Scope, key: &str) -> BoxFuture<'static, ()> {
        let mut rx = self.changes.subscribe();
        let (scope, key) = (scope.clone(), Arc::<str>::from(key));
        Box::pin(async move {
            loop {
                match rx.recv().await {
                    Ok(id) if id.0 == scope && id.1 == key => return,
                    Ok(_) => {}
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => return,
                    Err(tokio::sync::broadcast::error::RecvError::Closed) => {
                        std::future::pending::<()>().await;
                    }
                }
            }
        })
    }
}
