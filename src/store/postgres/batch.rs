//! Natural batching of lease mode's claims (`PostgresStore::with_batched_claims`).
//!
//! A claim goes to a batching connection ([`Slot`]). If nothing is in flight there
//! and a pooled connection is at hand, the claim leads the slot (`lead`): its own
//! caller sends it at once, alone, as the store does without batching
//! (`claim_checked_out`: the same answers, takeover, fencing, and release in doubt):
//! no timer, no task hop, no wait at low load. While a claim or a batch is in flight,
//! the claims that arrive queue up, and when it returns they go together as one
//! statement (`Sql::claim_batch`), up to a cap by count and by bytes: one round trip,
//! one plan, one commit for them all. Each claim gets its own row back, with the
//! columns of a single claim, and reads it as `claim_once` reads its own (`found`):
//! a replay, a 409, a 422, its insert, a re-read (in the next batch) when a concurrent
//! request inserted the key first, or a takeover, sent alone on a pooled connection.
//!
//! A lone claim's lead hands the slot over when the claim ends, fails, or its caller
//! gives up (then its own connection is closed, its statement cancelled, and its
//! insert released in doubt, as without batching), and as soon as it has gone
//! `shared::STALLED` unanswered: the claims queued behind it are then sent by the
//! slot's task (`drive`) while it waits on. A claim that finds the slot idle but every
//! pooled connection checked out does not lead: it queues, and `drive` sends it with
//! those that arrive while the connection is awaited.
//!
//! A batch is sent on a pooled connection, checked out for it (so it works behind a
//! transaction pooler: nothing outlives the statement), by a task of the slot's
//! (`drive`), so that a claim whose caller gives up does not cancel the others'.
//! What a batch's failure means for each claim in it is what it would have meant alone:
//!
//! - the connection lost: each claim's insert may have committed, and each is released
//!   in doubt by its own token (`release_in_doubt`), and fails as it would alone;
//! - no connection from the pool: each fails with that error;
//! - any other error: the statement rolled back, nothing landed; each claim runs again
//!   alone on a pooled connection (`claim_pooled`), which gives it its own answer and
//!   its own error (a bad key fails alone, not its batch);
//! - a caller that gave up: a claim still queued is never sent; one whose batch returns
//!   after its caller stopped waiting, having inserted, is released by its token; a
//!   batch whose callers have all stopped waiting is abandoned (its connection closed,
//!   the statement cancelled) and every claim in it released in doubt.
//!
//! A batch left unanswered for `shared::STALLED` (waiting on a row lock, or on a
//! connection that died without a word) goes on in a task of its own, and the slot
//! sends the next batch on another connection.

use std::{
    collections::VecDeque,
    future::Future,
    sync::{
        Arc, Mutex, PoisonError,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use tokio::sync::oneshot;
use tokio_postgres::{Row, types::ToSql};

use super::{
    Checkout, PostgresStore,
    adapt::InFlight,
    batch_complete::Completions,
    claim::{CLAIM_ATTEMPTS, Found, found, ms},
    errors::{again_if_it_lost_a_race, corrupt, lost_its_connection},
    lead::{Lanes, Lead, Sending},
    shared::STALLED,
    sql::col,
};
use crate::{
    Fingerprint, Scope,
    store::{Claim, ClaimRequest, FencingToken, StoreError, StoreErrorKind},
};

/// The bytes of keys, scopes and fingerprints one batch may carry: far more than a
/// batch of the usual keys needs, and a bound on a statement built from long ones.
const MAX_BATCH_BYTES: usize = 1 << 20;

/// A claim's share of a batch's bytes, besides its scope and key: its fingerprint and
/// three numbers.
const MEMBER_BYTES: usize = 32 + 3 * 8;

/// Batching connections and what is queued for them.
pub(super) struct Batcher {
    slots: Box<[Slot]>,
    /// How many of them take new claims (and completions), following the load.
    in_flight: Arc<InFlight>,
    /// Claims in one statement at most.
    max_claims: usize,
    /// Completions, batched the same way.
    completions: Arc<Completions>,
    /// Batch statements sent, and the claims sent in them.
    batches: AtomicU64,
    batched: AtomicU64,
}

/// A batching connection: at most one statement in flight (a batch, or a lone claim sent
/// by its caller, its lead), and the claims queued behind it.
#[derive(Default)]
struct Slot {
    state: Mutex<SlotState>,
}

#[derive(Default)]
struct SlotState {
    queue: VecDeque<Member>,
    /// A lead or a task (`drive`) is sending this slot's claims; the next claim queues.
    sending: bool,
}

/// A claim waiting for its batch, and where its answer goes.
struct Member {
    claim: Owned,
    reply: oneshot::Sender<Landed>,
}

/// A claim request, owned, with its token.
struct Owned {
    scope: Scope,
    key: String,
    fingerprint: Fingerprint,
    lease: Duration,
    ttl: Duration,
    token: FencingToken,
}

impl Owned {
    fn request(&self) -> ClaimRequest<'_> {
        ClaimRequest {
            scope: &self.scope,
            key: &self.key,
            fingerprint: self.fingerprint,
            lease: self.lease,
            ttl: self.ttl,
        }
    }

    fn bytes(&self) -> usize {
        self.scope.as_str().len() + self.key.len() + MEMBER_BYTES
    }
}

/// What a batch answers one of its claims.
enum Answer {
    /// Its row, read as a claim's own.
    Row(Row),
    /// The batch failed and nothing of it landed: claim alone.
    Alone,
    /// The error it would have had alone.
    Failed(StoreError),
    /// Sent alone by its own caller, which led the slot (`lead`): its claim's answer.
    Inline(Result<Claim, StoreError>),
}

/// An answer on its way to its claim. If it carries the claim's own insert and is
/// dropped before the claim takes it (its caller gave up in between), the insert is
/// released by its token: nobody would run the key, nor release it.
struct Landed {
    answer: Option<Answer>,
    undo: Option<(PostgresStore, Owned)>,
}

impl Landed {
    fn take(mut self) -> Answer {
        self.undo = None;
        self.answer
            .take()
            .unwrap_or_else(|| Answer::Failed(corrupt("a batch answer taken twice")))
    }
}

impl Drop for Landed {
    fn drop(&mut self) {
        if let Some((store, claim)) = self.undo.take() {
            tracing::debug!(token = %claim.token, "a batched claim landed after its caller gave up; releasing it");
            store.release_in_doubt(&claim.request(), claim.token);
        }
    }
}

impl Batcher {
    /// Up to `connections` batching connections (`adapt`), `max_claims` (at least 1)
    /// per statement.
    pub(super) fn new(connections: usize, max_claims: usize) -> Self {
        let in_flight = Arc::new(InFlight::new(connections));
        Self {
            slots: (0..connections.max(1)).map(|_| Slot::default()).collect(),
            max_claims: max_claims.max(1),
            completions: Arc::new(Completions::new(connections, max_claims, in_flight.clone())),
            in_flight,
            batches: AtomicU64::new(0),
            batched: AtomicU64::new(0),
        }
    }

    /// The batching of completions.
    pub(super) fn completions(&self) -> &Arc<Completions> {
        &self.completions
    }

    /// Batch statements sent so far.
    pub(super) fn batches(&self) -> u64 {
        self.batches.load(Ordering::Relaxed)
    }

    /// Claims sent in them.
    pub(super) fn batched(&self) -> u64 {
        self.batched.load(Ordering::Relaxed)
    }

    /// Claims queued behind a statement in flight (a batch, or a lead's lone claim),
    /// not sent yet.
    pub(super) fn waiting(&self) -> usize {
        self.slots.iter().map(|s| s.lock().queue.len()).sum()
    }

    /// The slot for the next claim, among those taking claims now (`adapt`): the first
    /// with nothing in flight (at light load the first slot, its claims sent by their
    /// callers), else the one with the fewest queued.
    fn pick(&self) -> usize {
        let mut best = (usize::MAX, 0);
        let taking = self.in_flight.limit().min(self.slots.len());
        for (i, slot) in self.slots[..taking].iter().enumerate() {
            let state = slot.lock();
            if !state.sending {
                return i;
            }
            if state.queue.len() < best.0 {
                best = (state.queue.len(), i);
            }
        }
        best.1
    }

    /// The claims of the next batch of slot `i`, up to the caps, those whose caller
    /// gave up left out.
    fn next_batch(&self, i: usize) -> Vec<Member> {
        let mut state = self.slots[i].lock();
        let mut batch = Vec::new();
        let mut bytes = 0;
        while batch.len() < self.max_claims {
            let Some(member) = state.queue.pop_front() else {
                break;
            };
            if member.reply.is_closed() {
                continue;
            }
            let size = member.claim.bytes();
            if !batch.is_empty() && bytes + size > MAX_BATCH_BYTES {
                state.queue.push_front(member);
                break;
            }
            bytes += size;
            batch.push(member);
        }
        batch
    }

    /// Whether the claim leads slot `i`: if it is idle, it is marked sending and the
    /// claim leads it (`true`); else `claim` is queued behind what is in flight there.
    fn lead_or_queue(&self, i: usize, claim: impl FnOnce() -> Member) -> bool {
        let mut state = self.slots[i].lock();
        if std::mem::replace(&mut state.sending, true) {
            state.queue.push_back(claim());
            false
        } else {
            true
        }
    }
}

impl Lanes for Batcher {
    fn keep_sending(&self, slot: usize) -> bool {
        let mut state = self.slots[slot].lock();
        state.queue.retain(|m| !m.reply.is_closed());
        if state.queue.is_empty() {
            state.sending = false;
        }
        state.sending
    }

    fn abandon(&self, slot: usize) {
        let mut state = self.slots[slot].lock();
        state.sending = false;
        // Dropped unanswered: each claim's caller gets an error.
        state.queue.clear();
    }

    fn drive(
        self: Arc<Self>,
        store: PostgresStore,
        sending: Sending<Self>,
    ) -> impl Future<Output = ()> + Send + 'static {
        drive(store, self, sending)
    }
}

impl Slot {
    fn lock(&self) -> std::sync::MutexGuard<'_, SlotState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Sends the batches of `sending`'s slot while claims wait for it.
async fn drive(store: PostgresStore, batcher: Arc<Batcher>, mut sending: Sending<Batcher>) {
    let slot = sending.slot();
    // The connection first, the claims then: those that arrive while it is sought go in
    // this batch too, and those whose caller gives up meanwhile are left out.
    while sending.go_on() {
        let client = store.client().await;
        let members = batcher.next_batch(slot);
        if members.is_empty() {
            if let Ok(client) = client {
                client.done();
            }
            continue;
        }
        batcher.batches.fetch_add(1, Ordering::Relaxed);
        batcher.in_flight.sent();
        batcher
            .batched
            .fetch_add(members.len() as u64, Ordering::Relaxed);
        let mut batch = Box::pin(send_batch(store.clone(), client, members));
        if tokio::time::timeout(STALLED, batch.as_mut()).await.is_err() {
            // The next batch goes on another connection; this one waits on.
            tokio::spawn(batch);
        }
    }
}

/// Sends one batch and answers each of its claims.
async fn send_batch(
    store: PostgresStore,
    client: Result<Checkout, StoreError>,
    mut members: Vec<Member>,
) {
    // One order for every batch: concurrent batches insert their keys in it, and
    // cannot deadlock. Stable: two claims of one key keep their order of arrival.
    members.sort_by(|a, b| {
        (a.claim.scope.as_str(), a.claim.key.as_str())
            .cmp(&(b.claim.scope.as_str(), b.claim.key.as_str()))
    });
    let (claims, mut replies): (Vec<Owned>, Vec<_>) =
        members.into_iter().map(|m| (m.claim, m.reply)).unzip();
    let answer_all = |replies: Vec<oneshot::Sender<Landed>>, answer: &dyn Fn() -> Answer| {
        for reply in replies {
            let _ = reply.send(Landed {
                answer: Some(answer()),
                undo: None,
            });
        }
    };
    let client = match client {
        Ok(client) => client,
        Err(e) => {
            answer_all(replies, &|| Answer::Failed(e.copied()));
            return;
        }
    };
    let scopes: Vec<&str> = claims.iter().map(|c| c.scope.as_str()).collect();
    let keys: Vec<&str> = claims.iter().map(|c| c.key.as_str()).collect();
    let fingerprints: Vec<&[u8]> = claims.iter().map(|c| c.fingerprint.as_bytes()).collect();
    let leases: Vec<i64> = claims.iter().map(|c| ms(c.lease)).collect();
    let ttls: Vec<i64> = claims.iter().map(|c| ms(c.ttl)).collect();
    let tokens: Vec<i64> = claims.iter().map(|c| c.token.get()).collect();
    let holder = store.holder();
    let params: [&(dyn ToSql + Sync); 7] = [
        &scopes,
        &keys,
        &fingerprints,
        &leases,
        &ttls,
        &tokens,
        &holder,
    ];
    // A batch of one (a claim that found every pooled connection checked out, or the
    // only one left of its batch) is sent as the claim of one key: the same row, and
    // a statement PostgreSQL plans once per connection, where the batch's, with its
    // arrays, is planned again for each execution.
    let one = &claims[0];
    let (scope, key, fingerprint) = (
        one.scope.as_str(),
        one.key.as_str(),
        one.fingerprint.as_bytes(),
    );
    let (lease, ttl) = (ms(one.lease), ms(one.ttl));
    let alone: [&(dyn ToSql + Sync); 7] = [
        &scope,
        &key,
        &fingerprint,
        &lease,
        &ttl,
        &one.token,
        &holder,
    ];
    let sent = {
        let statement = if claims.len() == 1 {
            store.query_on(&client, &store.sql.claim, &alone)
        } else {
            store.query_on(&client, &store.sql.claim_batch, &params)
        };
        let all_gave_up = futures_util::future::join_all(replies.iter_mut().map(|r| r.closed()));
        tokio::select! {
            rows = statement => Some(rows),
            _ = all_gave_up => None,
        }
    };
    let rows = match sent {
        Some(Ok(rows)) => {
            client.done();
            rows
        }
        // Every caller gave up: the connection is closed (and the statement cancelled),
        // and what may have landed is released.
        None => {
            drop(client);
            for claim in &claims {
                store.release_in_doubt(&claim.request(), claim.token);
            }
            return;
        }
        Some(Err(e)) if lost_its_connection(&e) => {
            drop(client);
            for claim in &claims {
                store.release_in_doubt(&claim.request(), claim.token);
            }
            let mut first = Some(e);
            for reply in replies {
                let e = first.take().unwrap_or_else(|| {
                    StoreError::new(
                        StoreErrorKind::Unavailable,
                        "the claim's connection was lost",
                    )
                });
                let _ = reply.send(Landed {
                    answer: Some(Answer::Failed(e)),
                    undo: None,
                });
            }
            return;
        }
        Some(Err(e)) => {
            // The statement rolled back: nothing of it landed.
            tracing::debug!(error = %e, claims = claims.len(), "a batch of claims failed; each claims alone");
            client.done();
            answer_all(replies, &|| Answer::Alone);
            return;
        }
    };
    let mut by_position: Vec<Option<Row>> = (0..claims.len()).map(|_| None).collect();
    let mut rows = rows.into_iter();
    if claims.len() == 1 {
        by_position[0] = rows.next();
    }
    for row in rows {
        let at = row
            .try_get::<_, i64>(col::N)
            .ok()
            .and_then(|n| usize::try_from(n).ok())
            .and_then(|n| n.checked_sub(1));
        if let Some(place) = at.and_then(|at| by_position.get_mut(at)) {
            *place = Some(row);
        }
    }
    for ((claim, reply), row) in claims.into_iter().zip(replies).zip(by_position) {
        let landed = match row {
            Some(row) => {
                let ours = row.get::<_, Option<i64>>(col::CLAIMED) == Some(claim.token.get());
                Landed {
                    answer: Some(Answer::Row(row)),
                    undo: ours.then(|| (store.clone(), claim)),
                }
            }
            None => Landed {
                answer: Some(Answer::Failed(corrupt("the batched claim returned no row"))),
                undo: None,
            },
        };
        // Sent back if the caller is gone: dropped, it releases an insert of its own.
        drop(reply.send(landed));
    }
}

impl PostgresStore {
    /// Claims in a batch (`with_batched_claims`), then reads the row as a claim of its
    /// own would.
    pub(super) async fn claim_batched(
        &self,
        batcher: &Arc<Batcher>,
        req: &ClaimRequest<'_>,
        token: FencingToken,
    ) -> Result<Claim, StoreError> {
        // A store in use purges what it expires (`with_background_purge`).
        self.purge.start();
        for _ in 0..CLAIM_ATTEMPTS {
            let arrived = Instant::now();
            let answer = self.in_a_batch(batcher, req, token).await;
            let now = Instant::now();
            batcher.in_flight.record(now - arrived, now);
            let row = match answer {
                Answer::Inline(claimed) => return claimed,
                Answer::Row(row) => row,
                Answer::Alone => return self.claim_pooled(req, token).await,
                Answer::Failed(e) => return Err(e),
            };
            match found(&row, req, self.sql.remember)?.0 {
                Found::Claim(Some(claim)) => return Ok(claim),
                Found::Claim(None) => {}
                Found::TakeOver(seen) => {
                    // Rare (a lapsed lease, an expired record, a holder gone): alone, as
                    // `claim_once`.
                    // A takeover in doubt took a token unknown here; it lapses with
                    // its lease, as one sent alone does.
                    let client = self.client().await?;
                    let taken = again_if_it_lost_a_race(|| {
                        self.take_over(&client, req, seen, self.holder())
                    })
                    .await;
                    client.done();
                    if let Some(claim) = taken? {
                        return Ok(claim);
                    }
                }
            }
        }
        Err(StoreError::new(
            StoreErrorKind::Timeout,
            "the key kept changing while it was being claimed",
        ))
    }

    /// Sends the claim alone, in this task, if its slot is idle and a pooled connection
    /// is at hand (`lead`); else queues it for a batch, starting the slot's sending if
    /// it is idle, and waits for its answer.
    async fn in_a_batch(
        &self,
        batcher: &Arc<Batcher>,
        req: &ClaimRequest<'_>,
        token: FencingToken,
    ) -> Answer {
        let (reply, answer) = oneshot::channel();
        let mut reply = Some(reply);
        let mut member = || Member {
            claim: Owned {
                scope: req.scope.clone(),
                key: req.key.to_owned(),
                fingerprint: req.fingerprint,
                lease: req.lease,
                ttl: req.ttl,
                token,
            },
            reply: reply.take().expect("one member per claim"),
        };
        let slot = batcher.pick();
        if batcher.lead_or_queue(slot, &mut member) {
            let mut lead = Lead::new(self, batcher, slot);
            match self.client_at_once().await {
                // As without batching, on a connection of its own: the same answers,
                // the same takeover, the same release in doubt (`InDoubt`) if its
                // connection is lost or its caller gives up midway.
                Ok(Some(client)) => {
                    batcher.batches.fetch_add(1, Ordering::Relaxed);
                    batcher.batched.fetch_add(1, Ordering::Relaxed);
                    batcher.in_flight.sent();
                    let claiming = std::pin::pin!(self.claim_checked_out(req, token, client));
                    let claimed = lead.run(claiming).await;
                    return Answer::Inline(claimed);
                }
                // Every pooled connection checked out: it waits for one as a batch,
                // with the claims that come meanwhile (the lead, dropped, starts
                // `drive`).
                Ok(None) => {
                    batcher.in_flight.starved();
                    batcher.slots[slot].lock().queue.push_front(member());
                }
                Err(e) => return Answer::Failed(e),
            }
        }
        match answer.await {
            Ok(landed) => landed.take(),
            Err(_) => Answer::Failed(StoreError::new(
                StoreErrorKind::Unavailable,
                "the claim's batch ended without an answer",
            )),
        }
    }
}
