//! A store in this process's memory.

use std::{
    cmp::Reverse,
    collections::{BTreeSet, BinaryHeap, HashMap, hash_map::Entry as MapEntry},
    mem::size_of,
    sync::{Arc, Mutex, MutexGuard, PoisonError},
    time::{Duration, Instant},
};

use bytes::Bytes;
use http::StatusCode;

use super::{
    BoxFuture, Claim, ClaimRequest, Fenced, FencingToken, Lease, Store, StoreError, StoreErrorKind,
    waiters::Waiters,
};
use crate::{Fingerprint, Scope, StoredResponse};

/// An in-memory [`Store`] for one process: examples, demos and tests of layer logic.
///
/// Claims are atomic within the process. Nothing survives a restart and nothing is
/// shared between replicas: use [`PostgresStore`](super::PostgresStore) for that.
///
/// **What it keeps, and for how long.** A record per key: its scope, the key, the
/// request's fingerprint and, once the handler's response is stored, its status, stored
/// headers and body. A record is kept until its TTL has passed (the layer's `ttl`, 24 h
/// by default) and no live lease holds it. Expired records are swept as claims arrive, a
/// few at a time, so that no claim pays for a sweep of them all, and by
/// [`purge`](Store::purge) ([`spawn_purger`](super::spawn_purger)) and
/// [`purge_expired`](Self::purge_expired).
///
/// **Its bound.** It holds at most [`with_max_entries`](Self::with_max_entries) records
/// (100 000 by default) and [`with_max_bytes`](Self::with_max_bytes) bytes of them
/// (64 MiB by default, as [`bytes`](Self::bytes) counts them), whichever comes first.
/// At the bound, a new key evicts completed records, those soonest to expire first. An
/// evicted key is gone as an expired one is: a retry with it runs the handler again, as
/// a new key. Keep the bound above the keys that arrive in the time clients retry
/// within. Running claims are never evicted: when only running claims are left, a claim
/// of a new key fails with a [`StoreError`] of kind
/// [`Unavailable`](StoreErrorKind::Unavailable), which the layer answers with
/// `503 store-unavailable` and `Retry-After`, without running the handler. A response
/// is always stored once its handler has run, evicting other completed records to make
/// room; when only running claims are left to evict, it takes the store over
/// `max_bytes` until the next new key evicts it in turn.
///
/// [`bytes`](Self::bytes) counts each record's key and stored status, headers and body,
/// plus 206 bytes for the record itself and its share of the store's map and queues (on
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

/// A record's key: its scope and its key.
type Id = (Scope, Arc<str>);

/// A time, in nanoseconds since the store was made: half the size of an `Instant`.
type At = u64;

struct Inner {
    /// Each record boxed: a map whose keys come and go sits at up to twice the slots
    /// its records fill, and a slot is then a third of what it would be.
    records: HashMap<Id, Box<Record>>,
    /// The scopes of the records, each with how many records it has: every record of a
    /// scope shares its name, whichever request brought it.
    scopes: HashMap<Scope, usize>,
    /// The running records, by the time they become free (their TTL has passed and
    /// their lease lapsed; a live holder renews it), soonest first: one entry each,
    /// taken out when the record completes, is released or renewed.
    running: BTreeSet<(At, Id)>,
    /// The completed records by expiry, soonest first: the order of both the sweep and
    /// eviction. A record's entry is the one at its `expires_at`; others are stale (the
    /// record went, or was claimed afresh), dropped when they come to the front, or all
    /// at once when they outnumber the records.
    expiry: BinaryHeap<Reverse<(At, Id)>>,
    /// The bytes the records are counted for (see [`RECORD_BYTES`]).
    bytes: usize,
    max_entries: usize,
    max_bytes: usize,
    /// Completed records evicted to make room.
    evicted: u64,
    epoch: Instant,
}

/// How many records a claim looks at, at most, to sweep them before it runs.
const SWEPT_PER_CLAIM: usize = 64;

/// What a record is counted for besides its key and its stored response: its slot in
/// the map at the map's fullest (seven slots in eight used), the record itself, its
/// entry in a queue, its key's reference counts, and the allocator's headers.
const RECORD_BYTES: usize = (size_of::<(Id, Box<Record>)>() + 1) * 8 / 7
    + size_of::<Record>()
    + ALLOCATION
    + size_of::<(At, Id)>()
    + ARC_COUNTS
    + ALLOCATION;

/// What a stored response is counted for besides its status, encoded headers and body:
/// the reference counts and allocator's header of their one allocation.
const STORED_BYTES: usize = ARC_COUNTS + ALLOCATION;

/// What a scope is counted for, once for all of its records, besides its name.
const SCOPE_BYTES: usize = (size_of::<(Scope, usize)>() + 1) * 8 / 7 + ARC_COUNTS + ALLOCATION;

/// The strong and weak counts at the start of an `Arc`'s allocation.
const ARC_COUNTS: usize = 2 * size_of::<usize>();

/// The allocator's header of an allocation and its rounding, on average.
const ALLOCATION: usize = 16;

struct Record {
    fingerprint: Fingerprint,
    token: FencingToken,
    expires_at: At,
    state: State,
}

enum State {
    /// Held by a claim until `locked_until`.
    Running {
        locked_until: At,
    },
    Completed(Stored),
}

/// A stored response in one allocation: the encoded headers, then the body.
#[derive(Clone)]
struct Stored {
    status: StatusCode,
    /// Where the headers end and the body begins (the headers of a response are far
    /// below 4 GiB, which would not decode, and replay as corrupt).
    split: u32,
    bytes: Arc<[u8]>,
}

impl Stored {
    fn new(response: &StoredResponse) -> Self {
        let headers = StoredResponse::encode_headers(&response.headers);
        let mut bytes = Vec::with_capacity(headers.len() + response.body.len());
        bytes.extend_from_slice(&headers);
        bytes.extend_from_slice(&response.body);
        Self {
            status: response.status,
            split: u32::try_from(headers.len()).unwrap_or(u32::MAX),
            bytes: Arc::from(bytes),
        }
    }

    /// The response to replay; the body shares the stored bytes.
    fn response(&self) -> Result<StoredResponse, StoreError> {
        let split = (self.split as usize).min(self.bytes.len());
        let headers = StoredResponse::decode_headers(&self.bytes[..split])
            .ok_or_else(|| StoreError::new(StoreErrorKind::Corrupt, "stored headers"))?;
        let body = if split == self.bytes.len() {
            Bytes::new()
        } else {
            Bytes::from_owner(self.bytes.clone()).slice(split..)
        };
        Ok(StoredResponse {
            status: self.status,
            headers,
            body,
        })
    }
}

impl Record {
    /// Past its TTL and not held by a live lease: it may be purged or claimed afresh.
    fn is_free(&self, now: At) -> bool {
        self.free_at() <= now
    }

    /// When it becomes free: at its expiry, or when its lease lapses if that is later.
    fn free_at(&self) -> At {
        match self.state {
            State::Completed(_) => self.expires_at,
            State::Running { locked_until } => self.expires_at.max(locked_until),
        }
    }

    /// The bytes a record of `key` is counted for (its scope's aside).
    fn cost(&self, key: &str) -> usize {
        RECORD_BYTES
            + key.len()
            + match &self.state {
                State::Running { .. } => 0,
                State::Completed(stored) => STORED_BYTES + stored.bytes.len(),
            }
    }
}

/// `now + d`, saturating in some 580 years instead of overflowing.
fn later(now: At, d: Duration) -> At {
    now.saturating_add(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

impl Inner {
    fn new() -> Self {
        Self {
            records: HashMap::new(),
            scopes: HashMap::new(),
            running: BTreeSet::new(),
            expiry: BinaryHeap::new(),
            bytes: 0,
            max_entries: MemoryStore::DEFAULT_MAX_ENTRIES,
            max_bytes: MemoryStore::DEFAULT_MAX_BYTES,
            evicted: 0,
            epoch: Instant::now(),
        }
    }

    fn now(&self) -> At {
        u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    /// The store's own copy of `scope`, counted for one more record.
    fn scope(&mut self, scope: &Scope) -> Scope {
        match self.scopes.entry(scope.clone()) {
            MapEntry::Occupied(mut held) => {
                *held.get_mut() += 1;
                held.key().clone()
            }
            MapEntry::Vacant(new) => {
                self.bytes += SCOPE_BYTES + scope.as_str().len();
                new.insert(1);
                scope.clone()
            }
        }
    }

    /// One record fewer in `scope`.
    fn drop_scope(&mut self, scope: &Scope) {
        if let Some(count) = self.scopes.get_mut(scope) {
            *count -= 1;
            if *count == 0 {
                self.scopes.remove(scope);
                self.bytes -= SCOPE_BYTES + scope.as_str().len();
            }
        }
    }

    /// The bytes a new record of `id` adds: its own, and its scope's if it is the first.
    fn cost_of_new(&self, id: &Id, record: &Record) -> usize {
        let scope = if self.scopes.contains_key(&id.0) {
            0
        } else {
            SCOPE_BYTES + id.0.as_str().len()
        };
        record.cost(&id.1) + scope
    }

    /// Adds a running record for a key that has none, with the store's copy of its
    /// scope.
    fn insert(&mut self, id: Id, record: Record) {
        let id = (self.scope(&id.0), id.1);
        self.bytes += record.cost(&id.1);
        self.running.insert((record.free_at(), id.clone()));
        self.records.insert(id, Box::new(record));
    }

    /// Removes `id`'s record, if any; its entry, its bytes, and its scope's with its last
    /// record, go with it.
    fn remove(&mut self, id: &Id) -> bool {
        let Some((id, record)) = self.records.remove_entry(id) else {
            return false;
        };
        if let State::Running { .. } = record.state {
            self.running.remove(&(record.free_at(), id.clone()));
        }
        self.bytes -= record.cost(&id.1);
        self.drop_scope(&id.0);
        true
    }

    /// Changes `id`'s running record with `f`, keeping its entry in `running` in step.
    /// `false` if `id` has no running record.
    fn update_running(&mut self, id: &Id, f: impl FnOnce(&mut Record)) -> bool {
        let Some(r) = self.records.get_mut(id) else {
            return false;
        };
        if !matches!(r.state, State::Running { .. }) {
            return false;
        }
        let key = (r.free_at(), id.clone());
        let was = self.running.take(&key);
        f(r);
        if let State::Running { .. } = r.state {
            // The entry's own key, moved to the record's new time.
            let (_, id) = was.unwrap_or(key);
            self.running.insert((r.free_at(), id));
        }
        true
    }

    /// Drops the stale entries of `expiry` once they outnumber the completed records
    /// (records purged or claimed afresh), so that it stays within a few times the
    /// records held.
    fn compact(&mut self) {
        let completed = self.records.len() - self.running.len();
        if self.expiry.len() > 2 * completed + SWEPT_PER_CLAIM {
            let mut expiry = Vec::with_capacity(completed);
            for (id, r) in &self.records {
                if let State::Completed(_) = r.state {
                    expiry.push(Reverse((r.expires_at, id.clone())));
                }
            }
            self.expiry = expiry.into();
        }
    }

    /// Whether `entry` is the own entry of a completed record in `expiry`.
    fn is_completed_at(&self, entry: &Reverse<(At, Id)>) -> bool {
        let Reverse((at, id)) = entry;
        matches!(
            self.records.get(id),
            Some(r) if r.expires_at == *at && matches!(r.state, State::Completed(_))
        )
    }

    /// Removes records that are free at `now`, looking at up to `looked` entries and
    /// removing up to `removed`; returns how many it removed.
    fn sweep(&mut self, now: At, looked: usize, removed: usize) -> usize {
        let mut gone = 0;
        for _ in 0..looked {
            if gone == removed {
                break;
            }
            if let Some((at, _)) = self.running.first()
                && *at <= now
            {
                if let Some((_, id)) = self.running.pop_first() {
                    // Its entry is gone already; the record follows.
                    if let Some((id, record)) = self.records.remove_entry(&id) {
                        self.bytes -= record.cost(&id.1);
                        self.drop_scope(&id.0);
                        gone += 1;
                    }
                }
                continue;
            }
            match self.expiry.peek() {
                Some(Reverse((at, _))) if *at <= now => {}
                _ => break,
            }
            let Some(entry) = self.expiry.pop() else {
                break;
            };
            if self.is_completed_at(&entry) {
                self.remove(&entry.0.1);
                gone += 1;
            }
        }
        gone
    }

    /// Evicts completed records, soonest to expire first and never `keep`'s, until
    /// `entries` more records of `bytes` more bytes fit within the bounds; `false` when
    /// they do not, and only running claims (and `keep`) are left to evict.
    fn make_room(&mut self, entries: usize, bytes: usize, keep: Option<&Id>) -> bool {
        let mut kept = None;
        let fits = loop {
            if self.records.len() + entries <= self.max_entries
                && self.bytes + bytes <= self.max_bytes
            {
                break true;
            }
            let Some(entry) = self.expiry.pop() else {
                break false;
            };
            if !self.is_completed_at(&entry) {
                continue;
            }
            if Some(&entry.0.1) == keep {
                kept = Some(entry);
                continue;
            }
            self.remove(&entry.0.1);
            self.evicted += 1;
        };
        if let Some(entry) = kept {
            self.expiry.push(entry);
        }
        fits
    }

    fn full(&self) -> StoreError {
        StoreError::new(
            StoreErrorKind::Unavailable,
            format!(
                "the memory store is full of running claims ({} records, {} bytes; at most {} records, {} bytes): no new key until one finishes",
                self.records.len(),
                self.bytes,
                self.max_entries,
                self.max_bytes
            ),
        )
    }
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

    /// Removes expired records now; returns how many.
    pub fn purge_expired(&self) -> usize {
        let mut inner = self.lock();
        let now = inner.now();
        let free: Vec<Id> = inner
            .records
            .iter()
            .filter(|(_, r)| r.is_free(now))
            .map(|(id, _)| id.clone())
            .collect();
        for id in &free {
            inner.remove(id);
        }
        // Their entries go too, here, rather than in a rebuild the next claim would pay.
        inner.compact();
        free.len()
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
            state: State::Running {
                locked_until: later(now, req.lease),
            },
        };
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
        let expired = held.is_free(now);
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
            State::Completed(stored) => {
                return Ok(Claimed::Replay(held.fingerprint, stored.clone()));
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

    fn announce(&self, lease: &Lease) {
        self.waiters.wake(&(lease.scope.clone(), lease.key.clone()));
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
                let Some(stored) = stored.take() else {
                    return;
                };
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
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request<'a>(
        scope: &'a Scope,
        key: &'a str,
        lease: Duration,
        ttl: Duration,
    ) -> ClaimRequest<'a> {
        ClaimRequest {
            scope,
            key,
            fingerprint: Fingerprint([0; 32]),
            lease,
            ttl,
        }
    }

    fn acquire(store: &MemoryStore, req: &ClaimRequest<'_>) -> Lease {
        match store.claim_now(req) {
            Ok(Claim::Acquired(lease)) => lease,
            _ => panic!("not acquired"),
        }
    }

    /// Counts the times it is woken.
    #[derive(Default)]
    struct Woken(std::sync::atomic::AtomicUsize);

    impl std::task::Wake for Woken {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }

    fn created(body: &str) -> StoredResponse {
        let mut headers = http::HeaderMap::new();
        headers.insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/json"),
        );
        StoredResponse {
            status: http::StatusCode::CREATED,
            headers,
            body: bytes::Bytes::from(body.to_owned()),
        }
    }

    fn holds(store: &MemoryStore, scope: &Scope, key: &str) -> bool {
        store
            .lock()
            .records
            .contains_key(&(scope.clone(), Arc::from(key)))
    }

    fn current_thread() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
    }

    #[test]
    fn at_its_bound_the_store_evicts_the_completed_records_soonest_to_expire() {
        let rt = current_thread();
        let store = MemoryStore::new().with_max_entries(4);
        let scope = Scope::anonymous();
        let (lease, hour) = (Duration::from_secs(60), Duration::from_secs(3600));
        // Completed in another order than they expire: k1 first, then k3, k2, k0.
        for (key, hours) in [("k0", 4), ("k1", 1), ("k2", 3), ("k3", 2)] {
            let held = acquire(&store, &request(&scope, key, lease, hour * hours));
            let stored = rt.block_on(store.complete(&held, &created(key), hour * hours));
            assert!(stored.unwrap().is_kept());
        }
        assert_eq!((store.len(), store.evicted()), (4, 0));
        let full_bytes = store.bytes();

        // Running claims of new keys push the completed records out, one each.
        let mut running = Vec::new();
        for (i, gone) in ["k1", "k3", "k2", "k0"].into_iter().enumerate() {
            running.push(acquire(
                &store,
                &request(&scope, &format!("r{i}"), lease, hour),
            ));
            assert!(!holds(&store, &scope, gone), "{gone} is still held");
            assert_eq!(store.len(), 4);
            assert_eq!(store.evicted(), i as u64 + 1);
            assert!(store.bytes() <= full_bytes);
        }

        // Only running claims are left: a new key is refused, and nothing is evicted.
        let refused = store.claim_now(&request(&scope, "r4", lease, hour));
        let error = refused.expect_err("a claim past the bound of running claims");
        assert_eq!(error.kind(), StoreErrorKind::Unavailable, "{error}");
        assert_eq!((store.len(), store.evicted()), (4, 4));
        for held in &running {
            assert!(
                rt.block_on(store.renew(held, lease)).unwrap().is_kept(),
                "a claim was lost"
            );
        }
        // Keys the store holds still answer as they did.
        assert!(matches!(
            store.claim_now(&request(&scope, "r0", lease, hour)),
            Ok(Claim::Running { .. })
        ));

        // An evicted key is a new key: claimed afresh, once there is room.
        assert!(rt.block_on(store.release(&running[0])).unwrap().is_kept());
        let again = acquire(&store, &request(&scope, "k1", lease, hour));
        assert_ne!(
            again.token,
            FencingToken::new(1),
            "a fresh claim's token is random"
        );
        assert_eq!(store.len(), 4);
    }

    #[test]
    fn the_bytes_held_stay_within_the_bound_and_are_all_given_back() {
        let rt = current_thread();
        let body = "x".repeat(1000);
        let one = RECORD_BYTES + 2 + STORED_BYTES + 40 + body.len();
        let store = MemoryStore::new().with_max_bytes(3 * one + one / 2);
        let scope = Scope::anonymous();
        let short = Duration::from_millis(300);
        for i in 0..10 {
            let key = format!("k{i}");
            let held = acquire(&store, &request(&scope, &key, short, short));
            assert!(store.bytes() <= store.max_bytes());
            assert!(
                rt.block_on(store.complete(&held, &created(&body), short))
                    .unwrap()
                    .is_kept()
            );
            assert!(store.bytes() <= store.max_bytes(), "{i}: {store:?}");
        }
        assert_eq!(store.len(), 3, "{store:?}");
        assert_eq!(store.evicted(), 7);
        assert_eq!(store.bytes(), 3 * one + SCOPE_BYTES);
        // What the records held goes with them: nothing is left counted.
        std::thread::sleep(Duration::from_millis(400));
        assert_eq!(rt.block_on(store.purge(100)).unwrap(), 3);
        assert_eq!((store.len(), store.bytes()), (0, 0));
    }

    #[test]
    fn a_response_is_stored_even_when_only_running_claims_are_left_to_evict() {
        let rt = current_thread();
        // Room for two running claims of one-letter keys, and no more.
        let store = MemoryStore::new().with_max_bytes(2 * (RECORD_BYTES + 1) + SCOPE_BYTES);
        let scope = Scope::anonymous();
        let long = Duration::from_secs(60);
        let a = acquire(&store, &request(&scope, "a", long, long));
        let b = acquire(&store, &request(&scope, "b", long, long));
        let refused = store.claim_now(&request(&scope, "c", long, long));
        assert_eq!(refused.unwrap_err().kind(), StoreErrorKind::Unavailable);
        // Over the bound once stored: the handler has run, and a retry must not run it
        // again.
        let big = "x".repeat(1000);
        assert!(
            rt.block_on(store.complete(&a, &created(&big), long))
                .unwrap()
                .is_kept()
        );
        assert!(store.bytes() > store.max_bytes());
        assert!(matches!(
            store.claim_now(&request(&scope, "a", long, long)),
            Ok(Claim::Completed { response, .. }) if response == created(&big)
        ));
        // A completion makes room by evicting others, never itself.
        assert!(
            rt.block_on(store.complete(&b, &created(&big), long))
                .unwrap()
                .is_kept()
        );
        assert!(holds(&store, &scope, "b"));
        assert!(!holds(&store, &scope, "a"));
        assert_eq!(store.evicted(), 1);
        // The next new key evicts it in turn.
        acquire(&store, &request(&scope, "c", long, long));
        assert!(!holds(&store, &scope, "b"));
        assert!(store.bytes() <= store.max_bytes());
    }

    #[test]
    fn a_scope_s_name_is_held_once_for_all_of_its_records() {
        let store = MemoryStore::new();
        let long = Duration::from_secs(60);
        let name = "auth:".to_owned() + &"0123456789abcdef".repeat(4);
        for i in 0..100 {
            // A scope of its own per request, as the default scope function makes.
            let scope = Scope::new(name.clone());
            acquire(&store, &request(&scope, &format!("k{i:02}"), long, long));
        }
        assert_eq!(
            store.bytes(),
            100 * (RECORD_BYTES + 3) + SCOPE_BYTES + name.len()
        );
        let inner = store.lock();
        let mut scopes = inner.records.keys().map(|(scope, _)| scope);
        let first = scopes.next().unwrap();
        assert!(scopes.all(|scope| std::ptr::eq(scope.as_str(), first.as_str())));
    }

    #[test]
    fn a_replay_is_the_stored_response_byte_for_byte() {
        let rt = current_thread();
        let store = MemoryStore::new();
        let scope = Scope::anonymous();
        let long = Duration::from_secs(60);
        let mut response = created("{\"id\":1}");
        response
            .headers
            .append("x-a", http::HeaderValue::from_static("1"));
        response
            .headers
            .append("x-a", http::HeaderValue::from_static("2"));
        let held = acquire(&store, &request(&scope, "k", long, long));
        assert!(
            rt.block_on(store.complete(&held, &response, long))
                .unwrap()
                .is_kept()
        );
        for _ in 0..2 {
            match store.claim_now(&request(&scope, "k", long, long)) {
                Ok(Claim::Completed {
                    response: replay, ..
                }) => assert_eq!(replay, response),
                _ => panic!("not replayed"),
            }
        }
        let held = acquire(&store, &request(&scope, "empty", long, long));
        let empty = StoredResponse {
            status: http::StatusCode::NO_CONTENT,
            headers: http::HeaderMap::new(),
            body: bytes::Bytes::new(),
        };
        assert!(
            rt.block_on(store.complete(&held, &empty, long))
                .unwrap()
                .is_kept()
        );
        assert!(matches!(
            store.claim_now(&request(&scope, "empty", long, long)),
            Ok(Claim::Completed { response, .. }) if response == empty
        ));
    }

    #[test]
    fn a_completion_wakes_the_requests_waiting_on_its_key_alone() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let store = MemoryStore::new();
        let scope = Scope::anonymous();
        let long = Duration::from_secs(60);
        let leases: Vec<_> = (0..100)
            .map(|i| acquire(&store, &request(&scope, &format!("k{i}"), long, long)))
            .collect();
        // A request waiting on each key, as `wait_for_running` does, first polled
        // while the key runs.
        let mut waits: Vec<_> = (0..100)
            .map(|i| {
                let mut wait = store.changed(&scope, &format!("k{i}"));
                let woken = Arc::new(Woken::default());
                let waker = std::task::Waker::from(woken.clone());
                let mut cx = std::task::Context::from_waker(&waker);
                assert!(wait.as_mut().poll(&mut cx).is_pending());
                (wait, woken, waker)
            })
            .collect();
        let response = StoredResponse {
            status: http::StatusCode::CREATED,
            headers: http::HeaderMap::new(),
            body: bytes::Bytes::new(),
        };
        assert!(
            rt.block_on(store.complete(&leases[7], &response, long))
                .unwrap()
                .is_kept()
        );
        let woken = |waits: &[(_, Arc<Woken>, _)]| -> Vec<usize> {
            waits
                .iter()
                .enumerate()
                .filter(|(_, (_, w, _))| w.0.load(std::sync::atomic::Ordering::SeqCst) > 0)
                .map(|(i, _)| i)
                .collect()
        };
        assert_eq!(woken(&waits), [7]);
        let (wait, _, waker) = &mut waits[7];
        let mut cx = std::task::Context::from_waker(waker);
        assert!(wait.as_mut().poll(&mut cx).is_ready());
        // A release wakes its key's waiters alone too.
        assert!(rt.block_on(store.release(&leases[3])).unwrap().is_kept());
        assert_eq!(woken(&waits), [3, 7]);
    }

    #[test]
    fn each_claim_sweeps_a_few_expired_records_and_purges_take_the_rest() {
        let store = MemoryStore::new();
        let scope = Scope::anonymous();
        let short = Duration::from_millis(500);
        for i in 0..1000 {
            acquire(&store, &request(&scope, &format!("k{i}"), short, short));
        }
        assert_eq!(store.len(), 1000);
        std::thread::sleep(Duration::from_millis(600));
        // One claim: its own record in, at most SWEPT_PER_CLAIM expired ones out.
        acquire(
            &store,
            &request(
                &scope,
                "new",
                Duration::from_secs(60),
                Duration::from_secs(60),
            ),
        );
        assert_eq!(store.len(), 1000 + 1 - SWEPT_PER_CLAIM);
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        assert_eq!(rt.block_on(store.purge(100)).unwrap(), 100);
        assert_eq!(store.purge_expired(), 1000 - SWEPT_PER_CLAIM - 100);
        assert_eq!(store.len(), 1, "the live claim stays");
        // The swept records gave their bytes back: the live claim's are left.
        assert_eq!(store.bytes(), RECORD_BYTES + "new".len() + SCOPE_BYTES);
        // The purged records' entries went with them: the live claim's is left.
        let inner = store.lock();
        assert_eq!((inner.running.len(), inner.expiry.len()), (1, 0));
    }

    #[test]
    fn released_and_completed_claims_leave_no_entry_behind() {
        let rt = current_thread();
        let store = MemoryStore::new();
        let scope = Scope::anonymous();
        let long = Duration::from_secs(3600);
        for i in 0..1000 {
            let held = acquire(&store, &request(&scope, &format!("k{i}"), long, long));
            if i % 2 == 0 {
                assert!(rt.block_on(store.release(&held)).unwrap().is_kept());
            } else {
                let stored = rt.block_on(store.complete(&held, &created("{}"), long));
                assert!(stored.unwrap().is_kept());
            }
        }
        // Gone at once, not when their leases would have lapsed: the released claims
        // with nothing behind, the completed ones with their entry of expiry alone.
        let inner = store.lock();
        assert_eq!(inner.records.len(), 500);
        assert_eq!((inner.running.len(), inner.expiry.len()), (0, 500));
    }

    #[test]
    fn renewed_and_completed_records_are_not_swept_at_their_first_time() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let store = MemoryStore::new();
        let scope = Scope::anonymous();
        let short = Duration::from_millis(500);
        let renewed = acquire(&store, &request(&scope, "renewed", short, short));
        let completed = acquire(&store, &request(&scope, "completed", short, short));
        assert!(
            rt.block_on(store.renew(&renewed, Duration::from_secs(60)))
                .unwrap()
                .is_kept()
        );
        let response = StoredResponse {
            status: http::StatusCode::CREATED,
            headers: http::HeaderMap::new(),
            body: bytes::Bytes::new(),
        };
        assert!(
            rt.block_on(store.complete(&completed, &response, Duration::from_secs(60)))
                .unwrap()
                .is_kept()
        );
        std::thread::sleep(Duration::from_millis(600));
        // Their first TTL has passed: each claim sweeps, and leaves them.
        for i in 0..3 {
            acquire(&store, &request(&scope, &format!("k{i}"), short, short));
        }
        assert_eq!(rt.block_on(store.purge(100)).unwrap(), 0);
        assert!(matches!(
            store.claim_now(&request(&scope, "renewed", short, short)),
            Ok(Claim::Running { .. })
        ));
        assert!(matches!(
            store.claim_now(&request(&scope, "completed", short, short)),
            Ok(Claim::Completed { .. })
        ));
        // A released key claimed afresh is swept by its new claim's time, not the old.
        let rt_lease = acquire(&store, &request(&scope, "again", short, short));
        assert!(rt.block_on(store.release(&rt_lease)).unwrap().is_kept());
        let long = Duration::from_secs(60);
        acquire(&store, &request(&scope, "again", long, long));
        std::thread::sleep(Duration::from_millis(600));
        assert_eq!(
            rt.block_on(store.purge(100)).unwrap(),
            3,
            "the k0..k2 claims only"
        );
        assert!(matches!(
            store.claim_now(&request(&scope, "again", long, long)),
            Ok(Claim::Running { .. })
        ));
    }
}
