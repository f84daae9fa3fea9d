//! A store in this process's memory.

use std::{
    cmp::Reverse,
    collections::{BinaryHeap, HashMap},
    sync::{Arc, Mutex, MutexGuard, PoisonError},
    time::{Duration, Instant},
};

use super::{BoxFuture, Claim, ClaimRequest, Lease, Store, StoreError, waiters::Waiters};
use crate::{Fingerprint, Scope, StoredResponse};

/// An in-memory [`Store`] for one process: examples, demos and tests of layer logic.
///
/// Claims are atomic within the process. Nothing survives a restart and nothing is
/// shared between replicas: use [`PostgresStore`](super::PostgresStore) for that.
/// Expired records are swept as claims arrive, a few at a time, so memory is bounded by
/// the keys of one TTL window and no claim pays for a sweep of them all. (The heap of
/// their due times is rebuilt, within one claim, only when its stale entries outnumber
/// the records: more releases within a lease than records held.)
///
/// ```
/// use tower_idempotency::{IdempotencyLayer, store::MemoryStore};
///
/// let layer = IdempotencyLayer::new(MemoryStore::new());
/// ```
#[derive(Clone, Default)]
pub struct MemoryStore {
    inner: Arc<Mutex<Inner>>,
    /// Requests waiting on keys, woken when theirs completes or is released.
    waiters: Arc<Waiters<(Scope, Arc<str>)>>,
}

/// A record's key: its scope and its key.
type Id = (Scope, Arc<str>);

#[derive(Default)]
struct Inner {
    records: HashMap<Id, Record>,
    /// When the sweep is next to look at each record, earliest first, with the token
    /// of the claim that made it. A record's own entry is the one at its `due_at` with
    /// its token; others are stale (the record went, was claimed afresh or taken over,
    /// or its time moved earlier and got an entry of its own), and are dropped when
    /// they come due, or all at once when they outnumber the records. When its entry
    /// comes due, a record is removed if it is free, or its entry put back for later.
    due: BinaryHeap<Reverse<(Instant, i64, Id)>>,
}

/// How many due entries a claim looks at, at most, before it runs.
const SWEPT_PER_CLAIM: usize = 64;

impl Inner {
    fn insert(&mut self, id: Id, mut record: Record, now: Instant) {
        record.due_at = record.next_look(now);
        self.due
            .push(Reverse((record.due_at, record.token, id.clone())));
        self.records.insert(id, record);
    }

    /// After `id`'s record changed: an entry of its own if it should be looked at sooner
    /// than its entry says (a completion with a TTL shorter than the lease). A later
    /// time needs none: the entry it has is put back when it comes due.
    fn reschedule(&mut self, id: &Id, now: Instant) {
        if let Some(r) = self.records.get_mut(id) {
            let at = r.next_look(now);
            if at < r.due_at {
                r.due_at = at;
                self.due.push(Reverse((at, r.token, id.clone())));
            }
        }
    }

    /// Drops the stale entries once they outnumber the records (released claims under
    /// a long lease, say), so that the heap stays within a few times the records held.
    fn compact(&mut self) {
        if self.due.len() > 2 * self.records.len() + SWEPT_PER_CLAIM {
            self.due = self
                .records
                .iter()
                .map(|(id, r)| Reverse((r.due_at, r.token, id.clone())))
                .collect();
        }
    }

    /// Removes records that are free at `now`, looking at up to `looked` due entries and
    /// removing up to `removed`; returns how many it removed.
    fn sweep(&mut self, now: Instant, looked: usize, removed: usize) -> usize {
        let mut gone = 0;
        for _ in 0..looked {
            if gone == removed || self.due.peek().is_none_or(|Reverse((at, ..))| *at > now) {
                break;
            }
            let Some(Reverse((at, token, id))) = self.due.pop() else {
                break;
            };
            match self.records.get_mut(&id) {
                Some(r) if r.token == token && r.due_at == at && r.is_free(now) => {
                    self.records.remove(&id);
                    gone += 1;
                }
                Some(r) if r.token == token && r.due_at == at => {
                    r.due_at = r.next_look(now);
                    self.due.push(Reverse((r.due_at, token, id)));
                }
                // Stale: the record has another entry of its own, or is gone.
                _ => {}
            }
        }
        gone
    }
}

struct Record {
    fingerprint: Fingerprint,
    token: i64,
    expires_at: Instant,
    state: State,
    /// The time of this record's own entry in `Inner::due`.
    due_at: Instant,
}

enum State {
    Running { locked_until: Instant },
    Completed(StoredResponse),
}

impl Record {
    /// Past its TTL and not held by a live lease: it may be purged or claimed afresh.
    fn is_free(&self, now: Instant) -> bool {
        self.free_at() <= now
    }

    /// When it becomes free: at its expiry, or when its lease lapses if that is later.
    fn free_at(&self) -> Instant {
        match self.state {
            State::Completed(_) => self.expires_at,
            State::Running { locked_until } => self.expires_at.max(locked_until),
        }
    }

    /// When the sweep is to look at it next: when its live lease lapses (it may have
    /// been released by then, and its entry is not kept for a TTL), else when it is free.
    fn next_look(&self, now: Instant) -> Instant {
        match self.state {
            State::Running { locked_until } if locked_until > now => locked_until,
            _ => self.free_at(),
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
        // Their entries go too, here, rather than in a rebuild the next claim would pay.
        inner.compact();
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
        inner.sweep(now, SWEPT_PER_CLAIM, usize::MAX);
        inner.compact();
        let id = (req.scope.clone(), Arc::<str>::from(req.key));
        let new_record = |token| Record {
            fingerprint: req.fingerprint,
            token,
            expires_at: later(now, req.ttl),
            state: State::Running {
                locked_until: later(now, req.lease),
            },
            due_at: now,
        };
        let lease = |token| Lease {
            scope: req.scope.clone(),
            key: id.1.clone(),
            token,
        };
        let Some(record) = inner.records.get_mut(&id) else {
            let token = super::fresh_token();
            inner.insert(id.clone(), new_record(token), now);
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
        inner.insert(id.clone(), new_record(token), now);
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
        self.waiters.wake(&(lease.scope.clone(), lease.key.clone()));
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
                inner.reschedule(&id, Instant::now());
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
                inner.reschedule(&id, Instant::now());
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
            Ok(inner.sweep(Instant::now(), usize::MAX, batch) as u64)
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
            Claim::Acquired(lease) => lease,
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
        assert!(rt.block_on(store.release(&leases[3])).unwrap());
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
        // The purged records' entries went with them: no claim is left to rebuild them.
        let due = store.lock().due.len();
        assert!(due <= 2 + SWEPT_PER_CLAIM, "{due} entries left");
    }

    #[test]
    fn released_claims_leave_nothing_behind_past_their_lease() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let store = MemoryStore::new();
        let scope = Scope::anonymous();
        let (lease, ttl) = (Duration::from_millis(500), Duration::from_secs(3600));
        for i in 0..100 {
            let held = acquire(&store, &request(&scope, &format!("k{i}"), lease, ttl));
            assert!(rt.block_on(store.release(&held)).unwrap());
        }
        assert_eq!(store.len(), 0);
        std::thread::sleep(Duration::from_millis(600));
        assert_eq!(rt.block_on(store.purge(100)).unwrap(), 0);
        // Their entries were due at their lease's end, not their TTL's: gone.
        assert_eq!(store.lock().due.len(), 0);
    }

    #[test]
    fn released_claims_under_a_long_lease_do_not_pile_up() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let store = MemoryStore::new();
        let scope = Scope::anonymous();
        let long = Duration::from_secs(3600);
        for i in 0..1000 {
            let held = acquire(&store, &request(&scope, &format!("k{i}"), long, long));
            assert!(rt.block_on(store.release(&held)).unwrap());
        }
        let inner = store.lock();
        assert!(
            inner.due.len() <= 2 * inner.records.len() + SWEPT_PER_CLAIM + 1,
            "{}",
            inner.due.len()
        );
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
        );
        let response = StoredResponse {
            status: http::StatusCode::CREATED,
            headers: http::HeaderMap::new(),
            body: bytes::Bytes::new(),
        };
        assert!(
            rt.block_on(store.complete(&completed, &response, Duration::from_secs(60)))
                .unwrap()
        );
        std::thread::sleep(Duration::from_millis(600));
        // Their first due time has passed: each claim looks, and puts them back.
        for i in 0..3 {
            acquire(&store, &request(&scope, &format!("k{i}"), short, short));
        }
        assert_eq!(rt.block_on(store.purge(100)).unwrap(), 0);
        assert!(matches!(
            store.claim_now(&request(&scope, "renewed", short, short)),
            Claim::Running { .. }
        ));
        assert!(matches!(
            store.claim_now(&request(&scope, "completed", short, short)),
            Claim::Completed { .. }
        ));
        // A released key claimed afresh is swept by its new claim's time, not the old.
        let rt_lease = acquire(&store, &request(&scope, "again", short, short));
        assert!(rt.block_on(store.release(&rt_lease)).unwrap());
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
            Claim::Running { .. }
        ));
    }
}
