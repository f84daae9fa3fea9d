//! A store in this process's memory: the store and its API here, its records and
//! their bound in [`records`].

mod records;
mod steps;

use records::{Id, Inner, Record, STORED_BYTES, SWEPT_PER_CLAIM, State, Stored, later};

use std::{
    cmp::Reverse,
    sync::{Arc, Mutex, MutexGuard, PoisonError},
    time::{Duration, SystemTime},
};

use super::{
    BoxFuture, Claim, ClaimRequest, Fenced, FencingToken, KeyRecord, Lease, RecordedStep, Removal,
    RunningKey, Store, StoreError, waiters::Waiters,
};
use crate::{Fingerprint, Scope, StoredResponse};

/// An in-memory [`Store`] for one process: examples, demos and tests of layer logic.
///
/// Claims are atomic within the process. Nothing survives a restart and nothing is
/// shared between replicas: use [`PostgresStore`](super::PostgresStore) for that. So a
/// holder never outlives its claims' store: a process that dies takes its running keys
/// with it, and nothing waits for a lease (what
/// [`PostgresStore::with_liveness`](super::PostgresStore::with_liveness) does across
/// processes needs nothing here).
///
/// **What it keeps, and for how long.** A record per key: its scope, the key, the
/// request's fingerprint and, once the handler's response is stored, its status, stored
/// headers and body. A record is kept until its TTL has passed (the layer's `ttl`, 24 h
/// by default) and no live lease holds it. Expired records are swept as claims arrive, a
/// few at a time, so that no claim pays for a sweep of them all, and by
/// [`purge`](Store::purge) ([`spawn_purger`](super::spawn_purger)) and
/// [`purge_expired`](Self::purge_expired).
///
/// **What it remembers.** Once a completed record's TTL has passed, its response is
/// dropped and the key is remembered for [`remember_keys_for`](Self::remember_keys_for)
/// more ([`DEFAULT_REMEMBER`](super::DEFAULT_REMEMBER), 7 days, by default): its
/// fingerprint, its response's status and when it was completed, and no headers or
/// body. A retry in that time is refused (`410 response-expired`), not run again.
///
/// **Its bound.** It holds at most [`with_max_entries`](Self::with_max_entries) records
/// (100 000 by default) and [`with_max_bytes`](Self::with_max_bytes) bytes of them
/// (64 MiB by default, as [`bytes`](Self::bytes) counts them), whichever comes first.
/// At the bound, a new key evicts remembered records, those soonest to be forgotten
/// first, then completed records, those soonest to expire first (a retry while a
/// response is kept is far likelier than one after it). An evicted key is gone as a
/// forgotten one is: a retry with it runs the handler again, as a new key. Keep the bound above the keys that arrive in the time clients retry
/// within. Running claims are never evicted: when only running claims are left, a claim
/// of a new key fails with a [`StoreError`] of kind
/// [`Unavailable`](super::StoreErrorKind::Unavailable), which the layer answers with
/// `503 store-unavailable` and `Retry-After`, without running the handler. A response
/// is always stored once its handler has run, evicting other completed records to make
/// room; when only running claims are left to evict, it takes the store over
/// `max_bytes` until the next new key evicts it in turn.
///
/// [`bytes`](Self::bytes) counts each record's key and stored status, headers and body,
/// plus 222 bytes for the record itself and its share of the store's map and queues (on
/// 64-bit targets), and each scope's name once for all of its records. On top of that
/// come the map's spare room (a map whose keys come and go holds up to twice the slots
/// its records fill) and the allocator's own overhead: resident memory runs at 1.3 to
/// 1.5 times what it counts (docs/benchmarks.md).
///
/// ```
/// use tower_idempotency::{IdempotencyLayer, store::MemoryStore};
///
/// let store = MemoryStore::new().with_max_entries(10_000).with_max_bytes(16 << 20);
/// let layer = IdempotencyLayer::new(store);
/// ```
#[derive(Clone)]
pub struct MemoryStore {
    inner: Arc<Mutex<Inner>>,
    /// Requests waiting on keys, woken when theirs completes or is released.
    waiters: Arc<Waiters<(Scope, Arc<str>)>>,
}

impl std::fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let inner = self.lock();
        f.debug_struct("MemoryStore")
            .field("records", &inner.records.len())
            .field("bytes", &inner.bytes)
            .field("max_entries", &inner.max_entries)
            .field("max_bytes", &inner.max_bytes)
            .finish()
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

/// A claim's answer, and what it needs read outside the lock.
enum Claimed {
    Now(Claim),
    Replay(Fingerprint, Stored),
}

impl MemoryStore {
    /// Records held at most by default: 100 000.
    pub const DEFAULT_MAX_ENTRIES: usize = 100_000;

    /// Bytes held at most by default, as [`bytes`](Self::bytes) counts them: 64 MiB.
    pub const DEFAULT_MAX_BYTES: usize = 64 << 20;

    /// An empty store, bounded by [`DEFAULT_MAX_ENTRIES`](Self::DEFAULT_MAX_ENTRIES)
    /// and [`DEFAULT_MAX_BYTES`](Self::DEFAULT_MAX_BYTES).
    pub fn new() -> Self {
        Self {
            inner: Arc::new(Mutex::new(Inner::new())),
            waiters: Arc::default(),
        }
    }

    /// Holds at most `records` records (at least 1); a new key past it evicts completed
    /// records, soonest to expire first. Clones of the store share the setting.
    pub fn with_max_entries(self, records: usize) -> Self {
        self.lock().max_entries = records.max(1);
        self
    }

    /// Holds at most `bytes` bytes of records, as [`bytes`](Self::bytes) counts them; a
    /// new key past it evicts completed records, soonest to expire first. Clones of the
    /// store share the setting.
    pub fn with_max_bytes(self, bytes: usize) -> Self {
        self.lock().max_bytes = bytes;
        self
    }

    /// Remembers a completed key for `window` once its response expired (its TTL
    /// passed): its fingerprint, its response's status and when it was completed, no
    /// headers or body. A retry in that window gets `410 response-expired` and runs
    /// nothing. [`DEFAULT_REMEMBER`](super::DEFAULT_REMEMBER) (7 days) by default;
    /// `Duration::ZERO` turns it off. Clones of the store share the setting.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::store::MemoryStore;
    ///
    /// let store = MemoryStore::new().remember_keys_for(Duration::from_secs(3 * 24 * 3600));
    /// assert_eq!(store.remembers_keys_for(), Duration::from_secs(3 * 24 * 3600));
    /// ```
    pub fn remember_keys_for(self, window: Duration) -> Self {
        self.lock().remember = later(0, window);
        self
    }

    /// How long a completed key is remembered once its response expired.
    pub fn remembers_keys_for(&self) -> Duration {
        Duration::from_nanos(self.lock().remember)
    }

    /// The most records it holds.
    pub fn max_entries(&self) -> usize {
        self.lock().max_entries
    }

    /// The most bytes it holds, as [`bytes`](Self::bytes) counts them.
    pub fn max_bytes(&self) -> usize {
        self.lock().max_bytes
    }

    /// The number of records held, expired ones included until swept.
    pub fn len(&self) -> usize {
        self.lock().records.len()
    }

    /// Whether the store holds no records.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes its records are counted for: each record's key and stored response
    /// (status, headers and body) and its share of the store's map and queues, and each
    /// scope's name once. Bounded by [`max_bytes`](Self::max_bytes), but for responses
    /// stored while only running claims were left to evict.
    pub fn bytes(&self) -> usize {
        self.lock().bytes
    }

    /// How many completed records were evicted to make room, since the store was made.
    pub fn evicted(&self) -> u64 {
        self.lock().evicted
    }

    /// How many remembered records were evicted to make room, since the store was made.
    pub fn evicted_remembered(&self) -> u64 {
        self.lock().evicted_remembered
    }

    /// Removes records past their time now (a remembered one: past the time it is
    /// remembered), and reduces completed ones whose response expired to remembered
    /// ones; returns how many it removed or reduced.
    pub fn purge_expired(&self) -> usize {
        let mut inner = self.lock();
        let now = inner.now();
        let remember = inner.remember;
        let free: Vec<Id> = inner
            .records
            .iter()
            .filter(|(_, r)| r.is_free(now, remember))
            .map(|(id, _)| id.clone())
            .collect();
        for id in &free {
            inner.remove(id);
        }
        let expired: Vec<Id> = inner
            .records
            .iter()
            .filter(|(_, r)| matches!(r.state, State::Completed(_)) && r.expires_at <= now)
            .map(|(id, _)| id.clone())
            .collect();
        for id in &expired {
            inner.reduce(id, now);
        }
        // Their entries go too, here, rather than in a rebuild the next claim would pay.
        inner.compact();
        free.len() + expired.len()
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // No code path panics while holding the lock, but a poisoned map is still
        // consistent: every mutation is a single insert, update or remove.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn claim_now(&self, req: &ClaimRequest<'_>) -> Result<Claim, StoreError> {
        let claimed = self.claim_locked(req)?;
        // A stored response is decoded outside the lock.
        match claimed {
            Claimed::Now(claim) => Ok(claim),
            Claimed::Replay(fingerprint, stored) => Ok(Claim::Completed {
                fingerprint,
                response: stored.response()?,
            }),
        }
    }

    fn claim_locked(&self, req: &ClaimRequest<'_>) -> Result<Claimed, StoreError> {
        let mut guard = self.lock();
        let inner = &mut *guard;
        let now = inner.now();
        inner.sweep(now, SWEPT_PER_CLAIM, usize::MAX);
        inner.compact();
        let id = (req.scope.clone(), Arc::<str>::from(req.key));
        let lease = |token| Lease {
            scope: req.scope.clone(),
            key: id.1.clone(),
            token,
        };
        let mut record = Record {
            fingerprint: req.fingerprint,
            token: FencingToken::new(0),
            expires_at: later(now, req.ttl),
            claimed_at: now,
            state: State::Running {
                locked_until: later(now, req.lease),
            },
        };
        let (wall_epoch, remember) = (inner.wall_epoch, inner.remember);
        let wall = |at| wall_epoch + Duration::from_nanos(at);
        let Some(held) = inner.records.get_mut(&id) else {
            let cost = inner.cost_of_new(&id, &record);
            if !inner.make_room(1, cost, None) {
                return Err(inner.full());
            }
            record.token = FencingToken::fresh();
            let token = record.token;
            inner.insert(id.clone(), record);
            return Ok(Claimed::Now(Claim::Acquired(lease(token))));
        };
        let expired = held.is_free(now, remember);
        match &held.state {
            _ if expired => {}
            State::Running { locked_until, .. }
                if *locked_until <= now && held.fingerprint == req.fingerprint => {}
            State::Running { locked_until, .. } => {
                return Ok(Claimed::Now(Claim::Running {
                    fingerprint: held.fingerprint,
                    retry_after: Duration::from_nanos(locked_until.saturating_sub(now)),
                }));
            }
            State::Completed(stored) if held.expires_at > now => {
                return Ok(Claimed::Replay(held.fingerprint, stored.clone()));
            }
            // Its response expired, not swept yet: remembered as if it were.
            State::Completed(stored) => {
                let forget_at = held.expires_at.saturating_add(remember);
                return Ok(Claimed::Now(Claim::Remembered {
                    fingerprint: held.fingerprint,
                    status: stored.status,
                    completed_at: wall(stored.completed_at),
                    remembered_until: wall(forget_at),
                }));
            }
            State::Remembered {
                status,
                completed_at,
            } => {
                return Ok(Claimed::Now(Claim::Remembered {
                    fingerprint: held.fingerprint,
                    status: *status,
                    completed_at: wall(*completed_at),
                    remembered_until: wall(held.expires_at),
                }));
            }
        }
        // Taken over, or claimed afresh once expired: the key's tokens only grow while
        // it has a record.
        record.token = held.token.next();
        let token = record.token;
        if matches!(held.state, State::Running { .. }) {
            // A running record of the same key takes the same bytes: nothing to make
            // room for, and running claims are never evicted.
            inner.update_running(&id, |held| *held = record);
        } else {
            // An expired response: its bytes go first.
            inner.remove(&id);
            let cost = inner.cost_of_new(&id, &record);
            if !inner.make_room(1, cost, None) {
                return Err(inner.full());
            }
            inner.insert(id.clone(), record);
        }
        Ok(Claimed::Now(Claim::Acquired(lease(token))))
    }

    /// Runs `f` on the running record held by `lease`; `false` when the lease is lost.
    fn with_held(&self, lease: &Lease, f: impl FnOnce(&mut Inner, Id)) -> Fenced {
        let mut inner = self.lock();
        let id = (lease.scope.clone(), lease.key.clone());
        let held = matches!(
            inner.records.get(&id),
            Some(r) if r.token == lease.token && matches!(r.state, State::Running { .. })
        );
        if held {
            f(&mut inner, id);
        }
        Fenced::kept_if(held)
    }

    /// The record of `key` in `scope`, as [`Store::look_up`] reads it; its response
    /// decoded outside the lock.
    fn look_up_now(&self, scope: &Scope, key: &str) -> Result<Option<KeyRecord>, StoreError> {
        let seen = {
            let inner = self.lock();
            let id = (scope.clone(), Arc::<str>::from(key));
            inner.records.get(&id).map(|r| Seen::of(r, &inner))
        };
        seen.map(Seen::record).transpose()
    }

    /// The running records claimed at least `older_than` ago, oldest first, at most
    /// `limit` of them ([`Store::running_keys`]).
    fn running_now(&self, older_than: Duration, limit: usize) -> Vec<RunningKey> {
        let inner = self.lock();
        let (now, older_than) = (inner.now(), later(0, older_than));
        let mut old: Vec<(&Id, &Record)> = inner
            .running
            .iter()
            .filter_map(|(_, id)| inner.records.get_key_value(id))
            .map(|(id, r)| (id, &**r))
            .filter(|(_, r)| now.saturating_sub(r.claimed_at) >= older_than)
            .collect();
        old.sort_by_key(|(_, r)| r.claimed_at);
        old.into_iter()
            .take(limit)
            .filter_map(|(id, r)| {
                let record = Seen::of(r, &inner).record().ok()?;
                Some(RunningKey::new(id.0.clone(), id.1.to_string(), record))
            })
            .collect()
    }

    /// Removes the record of `key` in `scope` if `removable` says so of it: what an
    /// operator's release and deletion do. `Refused` carries the record as it is.
    fn remove_if(
        &self,
        scope: &Scope,
        key: &str,
        removable: impl FnOnce(&Record) -> bool,
    ) -> Result<Removal, StoreError> {
        let id = (scope.clone(), Arc::<str>::from(key));
        let refused = {
            let mut inner = self.lock();
            let Some(record) = inner.records.get(&id) else {
                return Ok(Removal::Absent);
            };
            if removable(record) {
                let token = record.token;
                let running = matches!(record.state, State::Running { .. });
                inner.remove(&id);
                drop(inner);
                if running {
                    // Those waiting for it claim again, and one of them runs it.
                    self.waiters.wake(&id);
                }
                return Ok(Removal::Removed { token });
            }
            Seen::of(record, &inner)
        };
        Ok(Removal::Refused(Box::new(refused.record()?)))
    }

    fn announce(&self, lease: &Lease) {
        self.waiters.wake(&(lease.scope.clone(), lease.key.clone()));
    }
}

/// A record as read under the lock, to be made a [`KeyRecord`] outside it (a stored
/// response is decoded there).
struct Seen {
    token: FencingToken,
    fingerprint: Fingerprint,
    expires_in: Duration,
    claimed_at: SystemTime,
    state: Seeing,
}

/// What a record holds, as read under the lock.
enum Seeing {
    /// The lease left.
    Running(Duration),
    /// The stored response, and when it was stored.
    Completed(Stored, SystemTime),
    /// The status of the response, and when it was completed.
    Remembered(http::StatusCode, SystemTime),
}

impl Seen {
    fn of(record: &Record, inner: &Inner) -> Self {
        let now = inner.now();
        let left = |at: records::At| Duration::from_nanos(at.saturating_sub(now));
        let when = |at| inner.wall(at);
        let mut expires_in = left(record.expires_at);
        let state = match &record.state {
            State::Running { locked_until } => Seeing::Running(left(*locked_until)),
            State::Completed(stored) if record.expires_at > now => {
                Seeing::Completed(stored.clone(), when(stored.completed_at))
            }
            // Its response expired, not swept yet: remembered as if it were.
            State::Completed(stored) => {
                expires_in = left(record.expires_at.saturating_add(inner.remember));
                Seeing::Remembered(stored.status, when(stored.completed_at))
            }
            State::Remembered {
                status,
                completed_at,
            } => Seeing::Remembered(*status, when(*completed_at)),
        };
        Self {
            token: record.token,
            fingerprint: record.fingerprint,
            expires_in,
            claimed_at: when(record.claimed_at),
            state,
        }
    }

    fn record(self) -> Result<KeyRecord, StoreError> {
        let (token, fingerprint, expires_in) = (self.token, self.fingerprint, self.expires_in);
        let record = match self.state {
            Seeing::Running(lease_left) => {
                KeyRecord::running(token, fingerprint, lease_left, expires_in)
            }
            Seeing::Completed(stored, at) => {
                KeyRecord::completed(token, fingerprint, stored.response()?, expires_in)
                    .with_completed_at(at)
            }
            Seeing::Remembered(status, at) => {
                KeyRecord::remembered(token, fingerprint, status, expires_in).with_completed_at(at)
            }
        };
        Ok(record.with_claimed_at(self.claimed_at))
    }
}

impl Store for MemoryStore {
    fn claim<'a>(
        &'a self,
        request: &'a ClaimRequest<'a>,
    ) -> BoxFuture<'a, Result<Claim, StoreError>> {
        Box::pin(async move { self.claim_now(request) })
    }

    fn complete<'a>(
        &'a self,
        lease: &'a Lease,
        response: &'a StoredResponse,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Fenced, StoreError>> {
        Box::pin(async move {
            // Encoded and copied outside the lock.
            let mut stored = Some(Stored::new(response));
            let done = self.with_held(lease, |inner, id| {
                let now = inner.now();
                let Some(mut stored) = stored.take() else {
                    return;
                };
                stored.completed_at = now;
                let added = STORED_BYTES + stored.bytes.len();
                let expires_at = later(now, ttl);
                let completed = inner.update_running(&id, |r| {
                    r.state = State::Completed(stored);
                    r.expires_at = expires_at;
                });
                if !completed {
                    return;
                }
                inner.expiry.push(Reverse((expires_at, id.clone())));
                inner.bytes += added;
                // Stored whatever it takes, the handler having run: others make room.
                inner.make_room(0, 0, Some(&id));
            });
            if done.is_kept() {
                self.announce(lease);
            }
            Ok(done)
        })
    }

    fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<Fenced, StoreError>> {
        Box::pin(async move {
            let done = self.with_held(lease, |inner, id| {
                inner.remove(&id);
            });
            if done.is_kept() {
                self.announce(lease);
            }
            Ok(done)
        })
    }

    fn renew<'a>(
        &'a self,
        lease: &'a Lease,
        duration: Duration,
    ) -> BoxFuture<'a, Result<Fenced, StoreError>> {
        Box::pin(async move {
            Ok(self.with_held(lease, |inner, id| {
                let until = later(inner.now(), duration);
                inner.update_running(&id, |r| {
                    r.state = State::Running {
                        locked_until: until,
                    };
                    // A live holder's record outlives its TTL.
                    r.expires_at = r.expires_at.max(until);
                });
            }))
        })
    }

    fn purge<'a>(&'a self, batch: usize) -> BoxFuture<'a, Result<u64, StoreError>> {
        Box::pin(async move {
            let mut inner = self.lock();
            // Stale entries at most twice the records once compacted: the work under
            // the lock is bounded by what the store holds, and a purge that returns
            // less than `batch` has left nothing due.
            inner.compact();
            let now = inner.now();
            Ok(inner.sweep(now, usize::MAX, batch) as u64)
        })
    }

    fn changed(&self, scope: &Scope, key: &str) -> BoxFuture<'static, ()> {
        Box::pin(self.waiters.wait((scope.clone(), Arc::from(key))))
    }

    fn look_up<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a str,
    ) -> BoxFuture<'a, Result<Option<KeyRecord>, StoreError>> {
        Box::pin(std::future::ready(self.look_up_now(scope, key)))
    }

    fn running_keys(
        &self,
        older_than: Duration,
        limit: usize,
    ) -> BoxFuture<'_, Result<Vec<RunningKey>, StoreError>> {
        Box::pin(std::future::ready(Ok(self.running_now(older_than, limit))))
    }

    fn release_running<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a str,
        holder: Option<FencingToken>,
    ) -> BoxFuture<'a, Result<Removal, StoreError>> {
        let released = self.remove_if(scope, key, |r| {
            matches!(r.state, State::Running { .. }) && holder.is_none_or(|t| t == r.token)
        });
        Box::pin(std::future::ready(released))
    }

    fn delete_completed<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a str,
    ) -> BoxFuture<'a, Result<Removal, StoreError>> {
        let deleted = self.remove_if(scope, key, |r| !matches!(r.state, State::Running { .. }));
        Box::pin(std::future::ready(deleted))
    }

    fn steps<'a>(
        &'a self,
        lease: &'a Lease,
    ) -> BoxFuture<'a, Result<Option<Vec<RecordedStep>>, StoreError>> {
        Box::pin(std::future::ready(Ok(self.steps_of(lease))))
    }

    fn record_step<'a>(
        &'a self,
        lease: &'a Lease,
        step: &'a RecordedStep,
    ) -> BoxFuture<'a, Result<Fenced, StoreError>> {
        Box::pin(std::future::ready(Ok(self.record_step_held(lease, step))))
    }
}

#[cfg(test)]
mod tests;
