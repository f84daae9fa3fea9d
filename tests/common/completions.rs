//! A store whose completions (or releases) a test slows down or fails, everything else
//! passed through to the store under test.

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, AtomicUsize, Ordering},
    },
    time::Duration,
};

use tower_idempotency::{
    Scope, StoredResponse,
    store::{BoxFuture, Claim, ClaimRequest, Fenced, Lease, Store, StoreError, StoreErrorKind},
};

/// What happens to each completion before (or instead of) reaching the inner store.
#[derive(Clone, Copy, Debug)]
pub enum Completion {
    /// Reaches the store after this long.
    Slow(Duration),
    /// Fails at once as an unavailable store would.
    Failing,
    /// The first this many fail as `Failing` does; the others reach the store.
    FailingFirst(usize),
    /// Completions reach the store at once; releases after this long.
    SlowRelease(Duration),
    /// Completions land in the store at once, and answer this long after.
    AnsweredLate(Duration),
    /// Completions reach the store at once; claims after this long.
    SlowClaim(Duration),
    /// Claims reach the store after this long; releases never answer (a store that
    /// stopped answering after the claim landed); the rest at once.
    SlowClaimThenSilent(Duration),
    /// Renewals reach the store after this long; the rest at once.
    SlowRenew(Duration),
    /// Renewals fail as an unreachable store's would; the rest reach the store.
    RenewalsFail,
    /// The first this many releases fail as an unreachable store's would; the others,
    /// and the rest, reach the store.
    ReleasesFailFirst(usize),
    /// Renewals wait for [`Counts::let_renewals_go`] (counted as started meanwhile);
    /// the rest reach the store at once.
    HeldRenew,
    /// Completions panic, as a custom store's defect might; the rest reach the store.
    CompletionsPanic,
    /// Renewals panic, as a custom store's defect might; the rest reach the store.
    RenewalsPanic,
    /// Everything reaches the store as it is (for a store that only counts).
    Unaltered,
}

pub struct AlteredCompletions {
    inner: Arc<dyn Store>,
    completion: Completion,
    attempts: AtomicUsize,
    releases: Arc<AtomicUsize>,
    counts: Arc<Counts>,
}

/// What went through a counting store.
pub struct Counts {
    calls: AtomicUsize,
    deleted: AtomicU64,
    registrations: AtomicUsize,
    renewals: AtomicUsize,
    renewals_started: AtomicUsize,
    renewals_held: tokio::sync::Semaphore,
}

impl Default for Counts {
    fn default() -> Self {
        Self {
            calls: AtomicUsize::default(),
            deleted: AtomicU64::default(),
            registrations: AtomicUsize::default(),
            renewals: AtomicUsize::default(),
            renewals_started: AtomicUsize::default(),
            renewals_held: tokio::sync::Semaphore::new(0),
        }
    }
}

#[allow(dead_code)] // not every test binary reads every count
impl Counts {
    /// Waiters registered (the store answered).
    pub fn registrations(&self) -> usize {
        self.registrations.load(Ordering::SeqCst)
    }

    /// Renewals the store answered.
    pub fn renewals(&self) -> usize {
        self.renewals.load(Ordering::SeqCst)
    }

    /// Renewals on their way (with [`Completion::HeldRenew`], held or answered).
    pub fn renewals_started(&self) -> usize {
        self.renewals_started.load(Ordering::SeqCst)
    }

    /// Lets `n` renewals held by [`Completion::HeldRenew`] go on to the store.
    pub fn let_renewals_go(&self, n: usize) {
        self.renewals_held.add_permits(n);
    }

    /// Purges that returned.
    pub fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }

    /// Records they deleted, in all.
    pub fn deleted(&self) -> u64 {
        self.deleted.load(Ordering::SeqCst)
    }
}

impl AlteredCompletions {
    pub fn around(inner: Arc<dyn Store>, completion: Completion) -> Arc<dyn Store> {
        Self::counting_releases(inner, completion).0
    }

    /// [`around`](Self::around), and a count of the releases that reached the store.
    #[allow(dead_code)] // not every test binary counts them
    pub fn counting_releases(
        inner: Arc<dyn Store>,
        completion: Completion,
    ) -> (Arc<dyn Store>, Arc<AtomicUsize>) {
        let releases = Arc::new(AtomicUsize::new(0));
        let store = Arc::new(Self {
            inner,
            completion,
            attempts: AtomicUsize::new(0),
            releases: releases.clone(),
            counts: Arc::default(),
        });
        (store, releases)
    }

    /// `inner` unaltered, and what went through it: purges, registrations, renewals.
    #[allow(dead_code)] // not every test binary counts
    pub fn counting(inner: Arc<dyn Store>) -> (Arc<dyn Store>, Arc<Counts>) {
        Self::counting_with(inner, Completion::Unaltered)
    }

    /// [`around`](Self::around), and what went through it.
    #[allow(dead_code)] // not every test binary counts
    pub fn counting_with(
        inner: Arc<dyn Store>,
        completion: Completion,
    ) -> (Arc<dyn Store>, Arc<Counts>) {
        let counts = Arc::new(Counts::default());
        let store = Arc::new(Self {
            inner,
            completion,
            attempts: AtomicUsize::new(0),
            releases: Arc::default(),
            counts: counts.clone(),
        });
        (store, counts)
    }
}

fn refused() -> StoreError {
    StoreError::new(
        StoreErrorKind::Unavailable,
        "the test's store refuses completions",
    )
}

impl Store for AlteredCompletions {
    fn claim<'a>(
        &'a self,
        request: &'a ClaimRequest<'a>,
    ) -> BoxFuture<'a, Result<Claim, StoreError>> {
        match self.completion {
            Completion::SlowClaim(delay) | Completion::SlowClaimThenSilent(delay) => {
                Box::pin(async move {
                    tokio::time::sleep(delay).await;
                    self.inner.claim(request).await
                })
            }
            _ => self.inner.claim(request),
        }
    }

    fn complete<'a>(
        &'a self,
        lease: &'a Lease,
        response: &'a StoredResponse,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Fenced, StoreError>> {
        let attempt = self.attempts.fetch_add(1, Ordering::SeqCst);
        match self.completion {
            Completion::Slow(delay) => Box::pin(async move {
                tokio::time::sleep(delay).await;
                self.inner.complete(lease, response, ttl).await
            }),
            Completion::Failing => Box::pin(std::future::ready(Err(refused()))),
            Completion::CompletionsPanic => panic!("the test's store panics on completions"),
            Completion::FailingFirst(n) if attempt < n => {
                Box::pin(std::future::ready(Err(refused())))
            }
            Completion::FailingFirst(_)
            | Completion::SlowRelease(_)
            | Completion::SlowClaim(_)
            | Completion::SlowClaimThenSilent(_)
            | Completion::SlowRenew(_)
            | Completion::HeldRenew
            | Completion::RenewalsPanic
            | Completion::RenewalsFail
            | Completion::ReleasesFailFirst(_)
            | Completion::Unaltered => self.inner.complete(lease, response, ttl),
            Completion::AnsweredLate(delay) => Box::pin(async move {
                let landed = self.inner.complete(lease, response, ttl).await;
                tokio::time::sleep(delay).await;
                landed
            }),
        }
    }

    fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<Fenced, StoreError>> {
        let delay = match self.completion {
            Completion::SlowRelease(delay) => delay,
            Completion::SlowClaimThenSilent(_) => return Box::pin(std::future::pending()),
            Completion::ReleasesFailFirst(n) => {
                if self.releases.fetch_add(1, Ordering::SeqCst) < n {
                    return Box::pin(std::future::ready(Err(refused())));
                }
                // Counted above.
                return self.inner.release(lease);
            }
            _ => Duration::ZERO,
        };
        Box::pin(async move {
            tokio::time::sleep(delay).await;
            let released = self.inner.release(lease).await;
            self.releases.fetch_add(1, Ordering::SeqCst);
            released
        })
    }

    fn purge<'a>(&'a self, batch: usize) -> BoxFuture<'a, Result<u64, StoreError>> {
        Box::pin(async move {
            let purged = self.inner.purge(batch).await;
            if let Ok(n) = purged {
                self.counts.deleted.fetch_add(n, Ordering::SeqCst);
            }
            self.counts.calls.fetch_add(1, Ordering::SeqCst);
            purged
        })
    }

    fn register_waiter<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a str,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(async move {
            let registered = self.inner.register_waiter(scope, key).await;
            self.counts.registrations.fetch_add(1, Ordering::SeqCst);
            registered
        })
    }

    fn changed(&self, scope: &Scope, key: &str) -> BoxFuture<'static, ()> {
        self.inner.changed(scope, key)
    }

    fn abandoned_claim_wait(&self, lease: Duration) -> Duration {
        self.inner.abandoned_claim_wait(lease)
    }

    fn running_recheck(&self) -> Option<Duration> {
        self.inner.running_recheck()
    }

    fn renew<'a>(
        &'a self,
        lease: &'a Lease,
        duration: Duration,
    ) -> BoxFuture<'a, Result<Fenced, StoreError>> {
        let delay = match self.completion {
            Completion::SlowRenew(delay) => delay,
            Completion::RenewalsFail => return Box::pin(std::future::ready(Err(refused()))),
            Completion::RenewalsPanic => panic!("the test's store panics on renewals"),
            _ => Duration::ZERO,
        };
        Box::pin(async move {
            self.counts.renewals_started.fetch_add(1, Ordering::SeqCst);
            if matches!(self.completion, Completion::HeldRenew) {
                let held = self.counts.renewals_held.acquire().await;
                held.expect("the gate").forget();
            }
            tokio::time::sleep(delay).await;
            let renewed = self.inner.renew(lease, duration).await;
            self.counts.renewals.fetch_add(1, Ordering::SeqCst);
            renewed
        })
    }
}
