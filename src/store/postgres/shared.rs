//! Connections shared by concurrent statements, which tokio-postgres pipelines.
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
//!
//! The same dealing serves the store's reserve ([`Opened::Reserve`], see `reserve`):
//! connections made outside the pool for the statements of running claims, when the
//! pool has no idle connection for them.

use std::{
    sync::{
        Arc, Mutex, PoisonError,
        atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering},
    },
    time::Duration,
};

use deadpool_postgres::{ClientWrapper, Object, Pool};

use super::{
    checkout::{POOL_WAIT, pooled},
    errors::classify,
};
use crate::store::{StoreError, StoreErrorKind};

/// The `lock_timeout` of a shared connection: how long one claim may hold up the
/// claims queued behind it before it moves to a connection of its own.
const LOCK_TIMEOUT: Duration = Duration::from_millis(50);

/// How long a claim on a shared connection may go unanswered before its slot forgets
/// the connection. A claim takes milliseconds, and one that meets a row lock gives up
/// at `LOCK_TIMEOUT`; a connection silent for this long may have been dropped without
/// a word (by a NAT or a load balancer), and the next claims must not queue behind it.
/// The claims already sent on it keep it until they end.
pub(super) const STALLED: Duration = Duration::from_secs(1);

/// Claims queued on the least busy shared connection beyond which the next claim takes
/// a pooled connection instead: when commits are slow, claims that insert drain the
/// queues slowly, and the pool's connections overlap their commits.
const MAX_QUEUED: usize = 8;

/// Where shared connections come from, and what they are set up for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Opened {
    /// Claims: taken out of the pool for good (the pool may open others in their
    /// place), with a short `lock_timeout` (`LOCK_TIMEOUT`).
    ForClaims,
    /// The reserve: made by the pool's manager (its configuration, its TLS) outside the
    /// pool's `max_size`, so that they open while every pooled connection is checked
    /// out, with no session setting (safe behind any pooler).
    Reserve,
}

/// `n` connections, taken from the pool when first used and kept; each claim is dealt
/// to the one with the fewest claims in flight, so that claims queue behind a commit
/// as little as they can, and among those to the first: under light load claims stay
/// on one connection (one backend, its caches warm), and the others open only when
/// concurrent claims need them.
pub(super) struct Shared {
    opened: Opened,
    slots: Box<[Slot]>,
    /// Shared connections open, in use or forgotten and still closing: at most two per
    /// slot, so that a database slow to answer (a synchronous standby gone, a disk
    /// stalled), whose connections are forgotten one after the other, is not flooded
    /// with new ones.
    open: Arc<AtomicUsize>,
    /// Statements dealt to a shared connection, and those of them moved off it.
    dealt: AtomicU64,
    moved: AtomicU64,
}

#[derive(Default)]
struct Slot {
    current: Mutex<Option<Arc<Connection>>>,
    /// Claims dealt to this slot and not yet answered.
    in_flight: AtomicUsize,
    /// Held while the slot connects, so that a burst of statements opens one connection.
    connecting: tokio::sync::Mutex<()>,
    /// Attempts to connect that failed: claims that waited for one take the pool
    /// rather than each trying again in turn.
    failures: AtomicU64,
}

impl Slot {
    /// The slot's connection, unless it has closed (then the slot is emptied).
    fn open(&self) -> Option<Arc<Connection>> {
        let mut current = self.current.lock().unwrap_or_else(PoisonError::into_inner);
        match &*current {
            Some(client) if !client.client.is_closed() => Some(client.clone()),
            Some(_) => {
                *current = None;
                None
            }
            None => None,
        }
    }
}

/// A claim counted in flight on a slot until dropped (answered, failed or cancelled), or
/// until its connection is forgotten (`uncount`).
struct Queued<'a> {
    slot: &'a Slot,
    uncounted: AtomicBool,
}

impl<'a> Queued<'a> {
    fn new(slot: &'a Slot) -> Self {
        Self {
            slot,
            uncounted: AtomicBool::new(false),
        }
    }

    /// Takes the claim off its slot's count, once.
    fn uncount(&self) {
        if !self.uncounted.swap(true, Ordering::Relaxed) {
            self.slot.in_flight.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        self.uncount();
    }
}

/// A shared connection, and the slot it was dealt from.
///
/// A claim dropped before its statement is answered (its caller gave up on it) leaves
/// the connection in doubt: it may have stalled. The slot forgets it, as after a lost
/// connection, so that the next claims do not queue behind a statement that may never
/// be answered; the claims already sent on it keep it until they end.
pub(super) struct SharedClient<'a> {
    queued: Queued<'a>,
    client: Arc<Connection>,
    answered: bool,
}

impl<'a> SharedClient<'a> {
    fn dealt(queued: Queued<'a>, client: Arc<Connection>) -> Self {
        Self {
            queued,
            client,
            answered: false,
        }
    }

    /// Marks the claim's statement answered (with rows or an error): dropping the
    /// connection then leaves it in place.
    pub(super) fn answered(&mut self) {
        self.answered = true;
    }

    /// Forgets this connection after it lost its connection or stopped answering: see
    /// [`Shared::evict`].
    pub(super) fn evict(&self) {
        self.forget();
        self.queued.uncount();
    }

    /// Empties the slot if it still holds this connection.
    fn forget(&self) {
        let mut current = self
            .queued
            .slot
            .current
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if current
            .as_ref()
            .is_some_and(|c| Arc::ptr_eq(c, &self.client))
        {
            *current = None;
        }
    }
}

impl Drop for SharedClient<'_> {
    fn drop(&mut self) {
        if !self.answered {
            self.forget();
        }
    }
}

impl std::ops::Deref for SharedClient<'_> {
    type Target = ClientWrapper;

    fn deref(&self) -> &ClientWrapper {
        &self.client.client
    }
}

/// A shared connection, counted open (`Shared::open`) until it closes, when the last
/// claim on it lets it go.
struct Connection {
    client: ClientWrapper,
    _counted: CountedOpen,
}

/// One of `Shared::open`, taken before the connection is sought and given back when
/// dropped: when the connection closes, or when it never came (an error, or a claim
/// cancelled while it waited for the pool).
struct CountedOpen(Arc<AtomicUsize>);

impl Drop for CountedOpen {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A connection for a slot, `opened` so. One for claims is taken out of the pool for
/// good: the pool may open another in its place, and this one, with its own
/// `lock_timeout`, never goes back to serve a transaction. One for the reserve is made
/// by the pool's manager, the pool never knowing of it. `None` when as many shared
/// connections as allowed are open.
async fn connect(
    pool: &Pool,
    opened: Opened,
    open: &Arc<AtomicUsize>,
    limit: usize,
) -> Result<Option<Connection>, StoreError> {
    let room = |n: usize| (n < limit).then_some(n + 1);
    if open
        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, room)
        .is_err()
    {
        return Ok(None);
    }
    let counted = CountedOpen(open.clone());
    let client = match opened {
        Opened::ForClaims => Object::take(pooled(pool).await?),
        Opened::Reserve => made(pool).await?,
    };
    let connection = Connection {
        client,
        _counted: counted,
    };
    if opened == Opened::ForClaims {
        let set = format!("SET lock_timeout = '{}ms'", LOCK_TIMEOUT.as_millis());
        connection
            .client
            .batch_execute(&set)
            .await
            .map_err(classify)?;
    }
    Ok(Some(connection))
}

/// A new connection made by `pool`'s manager, as the pool makes its own, but outside
/// it: however many pooled connections are checked out. Bounded by the pool's create
/// timeout, or `POOL_WAIT` if it sets none. Its statement cache is detached from the
/// manager's, as those of connections taken out of the pool are.
async fn made(pool: &Pool) -> Result<ClientWrapper, StoreError> {
    use deadpool::managed::Manager as _;
    let bound = pool.timeouts().create.unwrap_or(POOL_WAIT);
    let mut client = match tokio::time::timeout(bound, pool.manager().create()).await {
        Ok(made) => made.map_err(classify)?,
        Err(_) => {
            return Err(StoreError::new(
                StoreErrorKind::Timeout,
                "a reserve connection did not open within the pool's create timeout",
            ));
        }
    };
    pool.manager().detach(&mut client);
    Ok(client)
}

impl Shared {
    /// `n` connections, `opened` so.
    pub(super) fn new(n: usize, opened: Opened) -> Self {
        Self {
            opened,
            slots: (0..n).map(|_| Slot::default()).collect(),
            open: Arc::default(),
            dealt: AtomicU64::new(0),
            moved: AtomicU64::new(0),
        }
    }

    /// The connection with the fewest claims in flight (the first of them on a tie),
    /// opened (or reopened) from `pool` if need be. `None`, for a pooled connection
    /// instead: every shared one has `MAX_QUEUED`, an attempt to open this one failed
    /// while the claim waited for it, or it would be one connection too many (two per
    /// slot, counting forgotten ones still open).
    pub(super) async fn get(&self, pool: &Pool) -> Result<Option<SharedClient<'_>>, StoreError> {
        let room = |queued: usize| (queued < MAX_QUEUED).then_some(queued + 1);
        let take = |slot: &Slot| {
            slot.in_flight
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, room)
                .is_ok()
        };
        let least_busy = self
            .slots
            .iter()
            .min_by_key(|s| s.in_flight.load(Ordering::Relaxed))
            .expect("at least one slot");
        // Concurrent claims may fill the least busy one between the look and the take:
        // then any other with room.
        let slot = if take(least_busy) {
            least_busy
        } else {
            match self.slots.iter().find(|s| take(s)) {
                Some(slot) => slot,
                None => return Ok(None),
            }
        };
        let queued = Queued::new(slot);
        if let Some(client) = slot.open() {
            return Ok(Some(self.dealt(queued, client)));
        }
        let failures = slot.failures.load(Ordering::Relaxed);
        let _connecting = slot.connecting.lock().await;
        if let Some(client) = slot.open() {
            return Ok(Some(self.dealt(queued, client)));
        }
        if slot.failures.load(Ordering::Relaxed) != failures {
            return Ok(None);
        }
        let connected = connect(pool, self.opened, &self.open, 2 * self.slots.len()).await;
        let client = match connected.inspect_err(|_| {
            slot.failures.fetch_add(1, Ordering::Relaxed);
        })? {
            Some(client) => Arc::new(client),
            None => return Ok(None),
        };
        *slot.current.lock().unwrap_or_else(PoisonError::into_inner) = Some(client.clone());
        Ok(Some(self.dealt(queued, client)))
    }

    /// `client` for the statement `queued`, counted among those dealt.
    fn dealt<'a>(&self, queued: Queued<'a>, client: Arc<Connection>) -> SharedClient<'a> {
        self.dealt.fetch_add(1, Ordering::Relaxed);
        SharedClient::dealt(queued, client)
    }

    /// Forgets `client` after it lost its connection or stopped answering (`STALLED`):
    /// the next claim dealt to its slot opens a new one rather than finding out again.
    /// (A connection that the server ended reports it closed only once its task has
    /// seen the end; one dropped silently may not report it for many minutes.)
    ///
    /// The claim comes off the slot's count too: a claim stuck on a silent connection
    /// may wait for many minutes, and claims stuck so must not keep the slot looking
    /// full, so that no new connection opens in it.
    pub(super) fn evict(&self, client: &SharedClient<'_>) {
        client.evict();
    }

    /// How many connections are shared.
    pub(super) fn len(&self) -> usize {
        self.slots.len()
    }

    /// Records a claim that met a row lock and moves to a pooled connection.
    pub(super) fn moved_off(&self) {
        self.moved.fetch_add(1, Ordering::Relaxed);
    }

    /// Statements dealt a shared connection.
    pub(super) fn dealt_count(&self) -> u64 {
        self.dealt.load(Ordering::Relaxed)
    }

    pub(super) fn moved(&self) -> u64 {
        self.moved.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool() -> Pool {
        let url = std::env::var("DATABASE_URL")
            .ok()
            .filter(|u| !u.is_empty())
            .unwrap_or_else(|| "postgres://postgres@127.0.0.1:5432/postgres".into());
        super::super::pool_for_url(&url, 4).expect("pool")
    }

    fn in_flight(shared: &Shared) -> Vec<usize> {
        let count = |s: &Slot| s.in_flight.load(Ordering::Relaxed);
        shared.slots.iter().map(count).collect()
    }

    #[tokio::test]
    async fn claims_go_to_the_least_busy_connection_then_to_the_pool() {
        let (pool, shared) = (pool(), Shared::new(2, Opened::ForClaims));
        let mut held = Vec::new();
        for _ in 0..2 * MAX_QUEUED {
            let client = shared.get(&pool).await.expect("connects");
            held.push(client.expect("room on a shared connection"));
        }
        // Dealt evenly over two connections, MAX_QUEUED each, and then full.
        assert_eq!(in_flight(&shared), [MAX_QUEUED, MAX_QUEUED]);
        let on_first = |c: &SharedClient<'_>| Arc::ptr_eq(&c.client, &held[0].client);
        assert_eq!(held.iter().filter(|c| on_first(c)).count(), MAX_QUEUED);
        assert!(
            shared
                .get(&pool)
                .await
                .expect("no connection needed")
                .is_none()
        );

        // A claim on the second connection is answered: the next one goes there.
        let second = held.iter().position(|c| !on_first(c)).expect("a second");
        let mut freed = held.swap_remove(second);
        freed.answered();
        let connection = freed.client.clone();
        drop(freed);
        assert_eq!(in_flight(&shared), [MAX_QUEUED, MAX_QUEUED - 1]);
        let next = shared.get(&pool).await.expect("connects").expect("room");
        assert!(Arc::ptr_eq(&next.client, &connection));
        assert_eq!(shared.dealt_count(), 2 * MAX_QUEUED as u64 + 1);
    }

    #[tokio::test]
    async fn forgotten_connections_still_open_count_against_the_limit() {
        let (pool, shared) = (pool(), Shared::new(1, Opened::ForClaims));
        let first = shared.get(&pool).await.expect("connects").expect("room");
        // Forgotten (it stopped answering), and still open for the claim on it.
        shared.evict(&first);
        let second = shared.get(&pool).await.expect("connects").expect("room");
        assert!(!Arc::ptr_eq(&first.client, &second.client), "a new one");
        shared.evict(&second);
        // Two open for one slot: the next claim takes a pooled connection instead.
        assert!(shared.get(&pool).await.expect("no connection").is_none());
        assert_eq!(shared.open.load(Ordering::Relaxed), 2);
        // The first closes with its last claim: one may open in its place.
        drop(first);
        assert_eq!(shared.open.load(Ordering::Relaxed), 1);
        let third = shared.get(&pool).await.expect("connects").expect("room");
        assert!(!Arc::ptr_eq(&third.client, &second.client), "a new one");
    }

    #[tokio::test]
    async fn a_claim_cancelled_while_its_connection_opens_gives_its_count_back() {
        let (pool, shared) = (pool(), Shared::new(1, Opened::ForClaims));
        // Polled once (counted, then waiting for the pool's new connection), dropped.
        let pending = {
            let mut get = std::pin::pin!(shared.get(&pool));
            std::future::poll_fn(|cx| std::task::Poll::Ready(get.as_mut().poll(cx).is_pending()))
                .await
        };
        assert!(pending, "the claim did not wait for its connection");
        assert_eq!(shared.open.load(Ordering::Relaxed), 0);
    }

    #[tokio::test]
    async fn claims_one_at_a_time_stay_on_the_first_connection() {
        let (pool, shared) = (pool(), Shared::new(4, Opened::ForClaims));
        let mut first = shared.get(&pool).await.expect("connects").expect("room");
        let connection = first.client.clone();
        first.answered();
        drop(first);
        for _ in 0..5 {
            let mut next = shared.get(&pool).await.expect("connects").expect("room");
            assert!(Arc::ptr_eq(&next.client, &connection), "moved to another");
            next.answered();
        }
        let opened = |s: &Slot| s.current.lock().expect("not poisoned").is_some();
        let opened: Vec<bool> = shared.slots.iter().map(opened).collect();
        assert_eq!(opened, [true, false, false, false]);
        // Two at once: the second goes to the next connection, which opens then.
        let (a, b) = (shared.get(&pool).await, shared.get(&pool).await);
        let (a, b) = (a.expect("connects"), b.expect("connects"));
        let (a, b) = (a.expect("room"), b.expect("room"));
        assert!(Arc::ptr_eq(&a.client, &connection));
        assert!(!Arc::ptr_eq(&b.client, &connection));
        assert_eq!(in_flight(&shared), [1, 1, 0, 0]);
    }

    #[tokio::test]
    async fn a_claim_given_up_before_its_answer_leaves_its_connection_behind() {
        let (pool, shared) = (pool(), Shared::new(1, Opened::ForClaims));
        let mut other = shared.get(&pool).await.expect("connects").expect("room");
        let given_up = shared.get(&pool).await.expect("connects").expect("room");
        assert!(Arc::ptr_eq(&other.client, &given_up.client));
        drop(given_up);
        // The next claim opens a new connection; the one sent on the old one keeps it.
        let mut next = shared.get(&pool).await.expect("connects").expect("room");
        assert!(!Arc::ptr_eq(&next.client, &other.client), "not replaced");
        other
            .simple_query("SELECT 1")
            .await
            .expect("the old one still answers");
        other.answered();
        drop(other);
        // An answered claim leaves its connection in place.
        let kept = next.client.clone();
        next.answered();
        drop(next);
        let again = shared.get(&pool).await.expect("connects").expect("room");
        assert!(
            Arc::ptr_eq(&again.client, &kept),
            "an answered claim evicted"
        );
        assert_eq!(in_flight(&shared), [1]);
    }

    #[tokio::test]
    async fn a_lost_connection_is_replaced_and_a_late_eviction_spares_its_successor() {
        let (pool, shared) = (pool(), Shared::new(1, Opened::ForClaims));
        let first = shared.get(&pool).await.expect("connects").expect("room");
        shared.evict(&first);
        let second = shared.get(&pool).await.expect("connects").expect("room");
        assert!(!Arc::ptr_eq(&first.client, &second.client), "not replaced");
        // A claim still holding the old connection fails later: the new one stays.
        shared.evict(&first);
        let third = shared.get(&pool).await.expect("connects").expect("room");
        assert!(
            Arc::ptr_eq(&second.client, &third.client),
            "evicted its successor"
        );
    }

    #[tokio::test]
    async fn claims_waiting_on_a_failed_connection_attempt_take_the_pool() {
        // A server that accepts connections and never answers.
        let silent = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let port = silent.local_addr().expect("address").port();
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((socket, _)) = silent.accept().await {
                held.push(socket);
            }
        });
        let config: tokio_postgres::Config = format!("postgres://postgres@127.0.0.1:{port}/x")
            .parse()
            .expect("url");
        let manager = deadpool_postgres::Manager::new(config, tokio_postgres::NoTls);
        let pool = Pool::builder(manager)
            .runtime(deadpool_postgres::Runtime::Tokio1)
            .create_timeout(Some(Duration::from_millis(200)))
            .build()
            .expect("pool");
        let shared = Shared::new(1, Opened::ForClaims);
        let get = || shared.get(&pool);
        let (a, b, c, d) = tokio::join!(get(), get(), get(), get());
        let claims = [a, b, c, d];
        // One claim tried to connect and failed; the others, which waited for it, did
        // not try again one after another.
        let failed = claims.iter().filter(|c| c.is_err()).count();
        let to_the_pool = claims.iter().filter(|c| matches!(c, Ok(None))).count();
        assert_eq!((failed, to_the_pool), (1, 3));
        assert_eq!(in_flight(&shared), [0]);
        assert_eq!(
            shared.dealt_count(),
            0,
            "no claim was given a shared connection"
        );
    }

    #[tokio::test]
    async fn reserve_connections_open_outside_a_pool_that_is_all_checked_out() {
        let (pool, reserve) = (pool(), Shared::new(1, Opened::Reserve));
        let mut held = Vec::new();
        for _ in 0..pool.status().max_size {
            held.push(pool.get().await.expect("a pooled connection"));
        }
        let mut client = reserve.get(&pool).await.expect("connects").expect("room");
        let show = "SHOW lock_timeout";
        let reserved = client.query_one(show, &[]).await.expect("answers");
        let pooled = held[0].query_one(show, &[]).await.expect("answers");
        // No session setting of its own: safe behind a transaction pooler.
        assert_eq!(reserved.get::<_, &str>(0), pooled.get::<_, &str>(0));
        client.answered();
        let status = pool.status();
        assert_eq!((status.size, status.available), (status.max_size, 0));
        assert_eq!(reserve.dealt_count(), 1);
    }

    #[tokio::test]
    async fn a_claim_cancelled_while_its_connection_opens_is_not_counted_in_flight() {
        let (pool, shared) = (pool(), Shared::new(1, Opened::ForClaims));
        // Polled once: the connection is still opening when the claim is dropped.
        let cancelled = tokio::time::timeout(Duration::ZERO, shared.get(&pool)).await;
        assert!(cancelled.is_err(), "the connection opened at once");
        assert_eq!(in_flight(&shared), [0]);
        let client = shared.get(&pool).await.expect("connects").expect("room");
        assert_eq!(in_flight(&shared), [1]);
        drop(client);
        assert_eq!(in_flight(&shared), [0]);
    }
}
