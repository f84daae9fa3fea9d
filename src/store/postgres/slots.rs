//! The accounting of shared connections (`shared`): which one a statement is dealt,
//! how many statements are in flight on each, how many connections are open, and when
//! a statement goes to a pooled connection instead.
//!
//! Nothing here talks to the database: a slot's connection is opened by the caller's
//! `connect`, and anything that can tell whether it has closed ([`Link`]) can be dealt.

use std::sync::{
    Arc, Mutex, PoisonError,
    atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering},
};

use deadpool_postgres::ClientWrapper;

use crate::store::StoreError;

/// Claims queued on the least busy shared connection beyond which the next claim takes
/// a pooled connection instead: when commits are slow, claims that insert drain the
/// queues slowly, and the pool's connections overlap their commits.
const MAX_QUEUED: usize = 8;

/// A connection a slot holds, which says whether it has closed.
pub(super) trait Link {
    /// Whether the connection has closed: the slot then opens another.
    fn is_closed(&self) -> bool;
}

impl Link for ClientWrapper {
    fn is_closed(&self) -> bool {
        tokio_postgres::Client::is_closed(self)
    }
}

/// `n` slots, each with a connection opened when first used and kept; each claim is
/// dealt to the one with the fewest claims in flight, so that claims queue behind a
/// commit as little as they can, and among those to the first: under light load claims
/// stay on one connection (one backend, its caches warm), and the others open only when
/// concurrent claims need them.
pub(super) struct Slots<C> {
    slots: Box<[Slot<C>]>,
    /// Connections open, in use or forgotten and still closing: at most two per slot,
    /// so that a database slow to answer (a synchronous standby gone, a disk stalled),
    /// whose connections are forgotten one after the other, is not flooded with new
    /// ones.
    open: Arc<AtomicUsize>,
    /// Statements dealt a connection.
    dealt: AtomicU64,
}

struct Slot<C> {
    current: Mutex<Option<Arc<Connection<C>>>>,
    /// Claims dealt to this slot and not yet answered.
    in_flight: AtomicUsize,
    /// Held while the slot connects, so that a burst of statements opens one connection.
    connecting: tokio::sync::Mutex<()>,
    /// Attempts to connect that failed: claims that waited for one take the pool
    /// rather than each trying again in turn.
    failures: AtomicU64,
}

impl<C> Default for Slot<C> {
    fn default() -> Self {
        Self {
            current: Mutex::new(None),
            in_flight: AtomicUsize::new(0),
            connecting: tokio::sync::Mutex::new(()),
            failures: AtomicU64::new(0),
        }
    }
}

impl<C: Link> Slot<C> {
    /// The slot's connection, unless it has closed (then the slot is emptied).
    fn open(&self) -> Option<Arc<Connection<C>>> {
        let mut current = self.current.lock().unwrap_or_else(PoisonError::into_inner);
        match &*current {
            Some(client) if !client.link.is_closed() => Some(client.clone()),
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
struct Queued<'a, C> {
    slot: &'a Slot<C>,
    uncounted: AtomicBool,
}

impl<'a, C> Queued<'a, C> {
    fn new(slot: &'a Slot<C>) -> Self {
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

impl<C> Drop for Queued<'_, C> {
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
pub(super) struct SharedClient<'a, C = ClientWrapper> {
    queued: Queued<'a, C>,
    client: Arc<Connection<C>>,
    answered: bool,
}

impl<C> SharedClient<'_, C> {
    /// Marks the claim's statement answered (with rows or an error): dropping the
    /// connection then leaves it in place.
    pub(super) fn answered(&mut self) {
        self.answered = true;
    }

    /// Forgets this connection after it lost its connection or stopped answering: the
    /// next claim dealt to its slot opens a new one rather than finding out again. (A
    /// connection that the server ended reports it closed only once its task has seen
    /// the end; one dropped silently may not report it for many minutes.)
    ///
    /// The claim comes off the slot's count too: a claim stuck on a silent connection
    /// may wait for many minutes, and claims stuck so must not keep the slot looking
    /// full, so that no new connection opens in it.
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

impl<C> Drop for SharedClient<'_, C> {
    fn drop(&mut self) {
        if !self.answered {
            self.forget();
        }
    }
}

impl<C> std::ops::Deref for SharedClient<'_, C> {
    type Target = C;

    fn deref(&self) -> &C {
        &self.client.link
    }
}

/// A shared connection, counted open (`Slots::open`) until it closes, when the last
/// claim on it lets it go.
struct Connection<C> {
    link: C,
    _counted: CountedOpen,
}

/// One of `Slots::open`, taken before the connection is sought and given back when
/// dropped: when the connection closes, or when it never came (an error, or a claim
/// cancelled while it waited for it).
struct CountedOpen(Arc<AtomicUsize>);

impl CountedOpen {
    /// One of `open`, unless `limit` are open already.
    fn take(open: &Arc<AtomicUsize>, limit: usize) -> Option<Self> {
        let room = |n: usize| (n < limit).then_some(n + 1);
        open.fetch_update(Ordering::Relaxed, Ordering::Relaxed, room)
            .ok()
            .map(|_| Self(open.clone()))
    }
}

impl Drop for CountedOpen {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl<C: Link> Slots<C> {
    /// `n` slots, with no connection yet.
    pub(super) fn new(n: usize) -> Self {
        Self {
            slots: (0..n).map(|_| Slot::default()).collect(),
            open: Arc::default(),
            dealt: AtomicU64::new(0),
        }
    }

    /// The connection with the fewest claims in flight (the first of them on a tie),
    /// opened (or reopened) with `connect` if need be. `None`, for a pooled connection
    /// instead: every slot has `MAX_QUEUED`, an attempt to open this one failed while
    /// the claim waited for it, or it would be one connection too many (two per slot,
    /// counting forgotten ones still open).
    pub(super) async fn get<F, Fut>(
        &self,
        connect: F,
    ) -> Result<Option<SharedClient<'_, C>>, StoreError>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<C, StoreError>>,
    {
        let room = |queued: usize| (queued < MAX_QUEUED).then_some(queued + 1);
        let take = |slot: &Slot<C>| {
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
        let Some(counted) = CountedOpen::take(&self.open, 2 * self.slots.len()) else {
            return Ok(None);
        };
        let link = connect().await.inspect_err(|_| {
            slot.failures.fetch_add(1, Ordering::Relaxed);
        })?;
        let client = Arc::new(Connection {
            link,
            _counted: counted,
        });
        *slot.current.lock().unwrap_or_else(PoisonError::into_inner) = Some(client.clone());
        Ok(Some(self.dealt(queued, client)))
    }

    /// `client` for the statement `queued`, counted among those dealt.
    fn dealt<'a>(&self, queued: Queued<'a, C>, client: Arc<Connection<C>>) -> SharedClient<'a, C> {
        self.dealt.fetch_add(1, Ordering::Relaxed);
        SharedClient {
            queued,
            client,
            answered: false,
        }
    }

    /// How many slots there are.
    pub(super) fn len(&self) -> usize {
        self.slots.len()
    }

    /// Statements dealt a connection.
    pub(super) fn dealt_count(&self) -> u64 {
        self.dealt.load(Ordering::Relaxed)
    }

    /// Claims in flight on each slot.
    #[cfg(test)]
    pub(super) fn in_flight(&self) -> Vec<usize> {
        let count = |s: &Slot<C>| s.in_flight.load(Ordering::Relaxed);
        self.slots.iter().map(count).collect()
    }

    /// Connections open, forgotten ones still held by a claim included.
    #[cfg(test)]
    pub(super) fn open_count(&self) -> usize {
        self.open.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use std::{future::Future, task::Poll};

    use super::*;
    use crate::store::StoreErrorKind;

    /// A connection that does nothing but close when told to.
    #[derive(Default)]
    struct Token {
        closed: AtomicBool,
    }

    impl Link for Token {
        fn is_closed(&self) -> bool {
            self.closed.load(Ordering::Relaxed)
        }
    }

    async fn opens() -> Result<Token, StoreError> {
        Ok(Token::default())
    }

    fn same(a: &SharedClient<'_, Token>, b: &SharedClient<'_, Token>) -> bool {
        Arc::ptr_eq(&a.client, &b.client)
    }

    /// A claim dealt a connection, opened with `opens` if need be.
    async fn dealt(slots: &Slots<Token>) -> SharedClient<'_, Token> {
        slots
            .get(opens)
            .await
            .expect("connects")
            .expect("room on a shared connection")
    }

    /// Polls `f` once and drops it; whether it was still pending then.
    async fn polled_once(f: impl Future) -> bool {
        let mut f = std::pin::pin!(f);
        std::future::poll_fn(|cx| Poll::Ready(f.as_mut().poll(cx).is_pending())).await
    }

    #[tokio::test]
    async fn claims_go_to_the_least_busy_connection_then_to_the_pool() {
        let slots = Slots::new(2);
        let mut held = Vec::new();
        for _ in 0..2 * MAX_QUEUED {
            held.push(dealt(&slots).await);
        }
        // Dealt evenly over two connections, MAX_QUEUED each, and then full.
        assert_eq!(slots.in_flight(), [MAX_QUEUED, MAX_QUEUED]);
        let on_first = |c: &SharedClient<'_, Token>| same(c, &held[0]);
        assert_eq!(held.iter().filter(|c| on_first(c)).count(), MAX_QUEUED);
        assert!(slots.get(opens).await.expect("no error").is_none());

        // A claim on the second connection is answered: the next one goes there.
        let second = held.iter().position(|c| !on_first(c)).expect("a second");
        let mut freed = held.swap_remove(second);
        freed.answered();
        let connection = freed.client.clone();
        drop(freed);
        assert_eq!(slots.in_flight(), [MAX_QUEUED, MAX_QUEUED - 1]);
        let next = dealt(&slots).await;
        assert!(Arc::ptr_eq(&next.client, &connection));
        assert_eq!(slots.dealt_count(), 2 * MAX_QUEUED as u64 + 1);
        assert_eq!(slots.open_count(), 2);
    }

    #[tokio::test]
    async fn forgotten_connections_still_open_count_against_the_limit() {
        let slots = Slots::new(1);
        let first = dealt(&slots).await;
        // Forgotten (it stopped answering), and still open for the claim on it.
        first.evict();
        let second = dealt(&slots).await;
        assert!(!same(&first, &second), "a new one");
        second.evict();
        // Two open for one slot: the next claim takes a pooled connection instead.
        assert!(slots.get(opens).await.expect("no error").is_none());
        assert_eq!(slots.open_count(), 2);
        // The first closes with its last claim: one may open in its place.
        drop(first);
        assert_eq!(slots.open_count(), 1);
        let third = dealt(&slots).await;
        assert!(!same(&third, &second), "a new one");
        assert_eq!(slots.open_count(), 2);
    }

    #[tokio::test]
    async fn a_claim_cancelled_while_its_connection_opens_gives_its_counts_back() {
        let slots = Slots::<Token>::new(1);
        // Polled once (counted, then waiting for its connection), dropped.
        let opening = slots.get(std::future::pending);
        assert!(polled_once(opening).await, "the connection opened at once");
        assert_eq!(slots.open_count(), 0);
        assert_eq!(slots.in_flight(), [0]);
        let client = dealt(&slots).await;
        assert_eq!((slots.open_count(), slots.in_flight()), (1, vec![1]));
        drop(client);
        assert_eq!(slots.in_flight(), [0]);
    }

    #[tokio::test]
    async fn claims_one_at_a_time_stay_on_the_first_connection() {
        let slots = Slots::new(4);
        let mut first = dealt(&slots).await;
        let connection = first.client.clone();
        first.answered();
        drop(first);
        for _ in 0..5 {
            let mut next = dealt(&slots).await;
            assert!(Arc::ptr_eq(&next.client, &connection), "moved to another");
            next.answered();
        }
        let opened = |s: &Slot<Token>| s.current.lock().expect("not poisoned").is_some();
        let opened: Vec<bool> = slots.slots.iter().map(opened).collect();
        assert_eq!(opened, [true, false, false, false]);
        // Two at once: the second goes to the next connection, which opens then.
        let (a, b) = (dealt(&slots).await, dealt(&slots).await);
        assert!(Arc::ptr_eq(&a.client, &connection));
        assert!(!Arc::ptr_eq(&b.client, &connection));
        assert_eq!(slots.in_flight(), [1, 1, 0, 0]);
        assert_eq!(slots.open_count(), 2);
    }

    #[tokio::test]
    async fn a_claim_given_up_before_its_answer_leaves_its_connection_behind() {
        let slots = Slots::new(1);
        let mut other = dealt(&slots).await;
        let given_up = dealt(&slots).await;
        assert!(same(&other, &given_up));
        drop(given_up);
        // The next claim opens a new connection; the one sent on the old one keeps it.
        let mut next = dealt(&slots).await;
        assert!(!same(&next, &other), "not replaced");
        assert_eq!(slots.open_count(), 2, "the old one closed under its claim");
        other.answered();
        drop(other);
        // It closes with the last claim on it.
        assert_eq!(slots.open_count(), 1);
        // An answered claim leaves its connection in place.
        let kept = next.client.clone();
        next.answered();
        drop(next);
        let again = dealt(&slots).await;
        assert!(
            Arc::ptr_eq(&again.client, &kept),
            "an answered claim evicted"
        );
        assert_eq!(slots.in_flight(), [1]);
    }

    #[tokio::test]
    async fn a_lost_connection_is_replaced_and_a_late_eviction_spares_its_successor() {
        let slots = Slots::new(1);
        let first = dealt(&slots).await;
        first.evict();
        let second = dealt(&slots).await;
        assert!(!same(&first, &second), "not replaced");
        // A claim still holding the old connection fails later: the new one stays.
        first.evict();
        let third = dealt(&slots).await;
        assert!(same(&second, &third), "evicted its successor");
    }

    #[tokio::test]
    async fn a_closed_connection_is_replaced_on_its_next_use() {
        let slots = Slots::new(1);
        let mut first = dealt(&slots).await;
        first.answered();
        first.closed.store(true, Ordering::Relaxed);
        let second = dealt(&slots).await;
        assert!(!same(&first, &second), "dealt a closed connection");
        drop(first);
        assert_eq!(slots.open_count(), 1);
    }

    #[tokio::test]
    async fn claims_waiting_on_a_failed_connection_attempt_take_the_pool() {
        let slots = Slots::<Token>::new(1);
        let fails = || async {
            // The others queue for the slot meanwhile.
            tokio::task::yield_now().await;
            Err(StoreError::new(StoreErrorKind::Unavailable, "refused"))
        };
        let get = || slots.get(fails);
        let (a, b, c, d) = tokio::join!(get(), get(), get(), get());
        let claims = [a, b, c, d];
        // One claim tried to connect and failed; the others, which waited for it, did
        // not try again one after another.
        let failed = claims.iter().filter(|c| c.is_err()).count();
        let to_the_pool = claims.iter().filter(|c| matches!(c, Ok(None))).count();
        assert_eq!((failed, to_the_pool), (1, 3));
        assert_eq!(slots.in_flight(), [0]);
        assert_eq!(slots.open_count(), 0);
        assert_eq!(slots.dealt_count(), 0, "no claim was given a connection");
    }
}
