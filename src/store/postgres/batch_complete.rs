//! Natural batching of lease mode's completions, with batched claims
//! (`PostgresStore::with_batched_claims`): the completions that arrive while one is in
//! flight go together as one `UPDATE … FROM unnest(…)` when it returns, each row still
//! checked by its own fencing token, the result reported per completion, and the
//! waiters of each completed row notified.
//!
//! A completion finding nothing in flight leads its slot (`lead`): its own caller sends
//! it at once, alone, as without batching (`complete_alone`: the statement of one key),
//! and the completions that arrive meanwhile queue behind it; its lead hands the slot
//! over to the slot's task (`drive`) when it ends, fails or is given up on, or once it
//! has gone `shared::STALLED` unanswered (waiting on a row lock), while it waits on.
//! A batch goes on the connection a completion alone would take (an idle
//! pooled one, else the store's reserve: `running_client`). Its failure is each
//! completion's: a lost connection or a connection that could not be had fails each
//! as it would have failed alone (the layer retries a failed completion); any other
//! error rolled the whole statement back, and each completion is sent again alone.
//! Concurrent batches update their rows in the order of their keys, sorted; should
//! their plans still meet in another order, PostgreSQL ends one with a deadlock error,
//! and its completions are sent again alone.

use std::{
    collections::VecDeque,
    future::Future,
    sync::{Arc, Mutex, PoisonError},
    time::{Duration, Instant},
};

use tokio::sync::oneshot;
use tokio_postgres::types::ToSql;

use super::{
    PostgresStore,
    adapt::InFlight,
    claim::ms,
    errors::{again_if_it_lost_a_race, lost_its_connection},
    lead::{Lanes, Lead, Sending},
    shared::STALLED,
};
use crate::{
    StoredResponse,
    store::{Fenced, Lease, StoreError, StoreErrorKind},
};

/// What a batch answers one of its completions.
enum Done {
    Kept(Fenced),
    /// The batch failed and nothing of it landed: complete alone.
    Alone,
    Failed(StoreError),
}

struct Member {
    lease: Lease,
    response: StoredResponse,
    ttl: Duration,
    reply: oneshot::Sender<Done>,
}

#[derive(Default)]
struct SlotState {
    queue: VecDeque<Member>,
    sending: bool,
}

/// Batching connections for completions, and what is queued for them.
pub(super) struct Completions {
    slots: Box<[Mutex<SlotState>]>,
    max: usize,
    /// How many slots take new completions, shared with the claims' (`adapt`).
    in_flight: Arc<InFlight>,
}

impl Completions {
    pub(super) fn new(connections: usize, max: usize, in_flight: Arc<InFlight>) -> Self {
        Self {
            slots: (0..connections.max(1)).map(|_| Mutex::default()).collect(),
            max: max.max(1),
            in_flight,
        }
    }

    fn lock(&self, i: usize) -> std::sync::MutexGuard<'_, SlotState> {
        self.slots[i].lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Among the slots taking completions now (`adapt`), the first with nothing in
    /// flight, else the one with the fewest queued.
    fn pick(&self) -> usize {
        let mut best = (usize::MAX, 0);
        for i in 0..self.in_flight.limit().min(self.slots.len()) {
            let state = self.lock(i);
            if !state.sending {
                return i;
            }
            if state.queue.len() < best.0 {
                best = (state.queue.len(), i);
            }
        }
        best.1
    }

    /// Whether the completion leads slot `i`: if it is idle, it is marked sending and
    /// the completion leads it (`true`); else `member` is queued behind what is in
    /// flight there.
    fn lead_or_queue(&self, i: usize, member: impl FnOnce() -> Member) -> bool {
        let mut state = self.lock(i);
        if std::mem::replace(&mut state.sending, true) {
            state.queue.push_back(member());
            false
        } else {
            true
        }
    }

    /// Completions queued behind a statement in flight (a batch, or a lead's lone
    /// completion).
    pub(super) fn waiting(&self) -> usize {
        (0..self.slots.len())
            .map(|i| self.lock(i).queue.len())
            .sum()
    }

    /// The completions of the next batch of slot `i`, up to the cap, those whose
    /// caller gave up left out (never sent: the layer retries a completion it gave up
    /// on, with the lease renewed meanwhile).
    fn next_batch(&self, i: usize) -> Vec<Member> {
        let mut state = self.lock(i);
        let mut batch = Vec::new();
        while batch.len() < self.max {
            let Some(member) = state.queue.pop_front() else {
                break;
            };
            if !member.reply.is_closed() {
                batch.push(member);
            }
        }
        batch
    }
}

impl Lanes for Completions {
    fn keep_sending(&self, slot: usize) -> bool {
        let mut state = self.lock(slot);
        state.queue.retain(|m| !m.reply.is_closed());
        if state.queue.is_empty() {
            state.sending = false;
        }
        state.sending
    }

    fn abandon(&self, slot: usize) {
        let mut state = self.lock(slot);
        state.sending = false;
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

/// Sends the batches of `sending`'s slot while completions wait for it.
async fn drive(
    store: PostgresStore,
    completions: Arc<Completions>,
    mut sending: Sending<Completions>,
) {
    let slot = sending.slot();
    while sending.go_on() {
        let members = completions.next_batch(slot);
        if members.is_empty() {
            continue;
        }
        completions.in_flight.sent();
        let mut batch = Box::pin(send_batch(store.clone(), members));
        if tokio::time::timeout(STALLED, batch.as_mut()).await.is_err() {
            // The next batch goes on another connection; this one waits on.
            tokio::spawn(batch);
        }
    }
}

async fn send_batch(store: PostgresStore, mut members: Vec<Member>) {
    members.sort_by(|a, b| {
        (a.lease.scope.as_str(), &*a.lease.key).cmp(&(b.lease.scope.as_str(), &*b.lease.key))
    });
    let client = match store.running_client().await {
        Ok(client) => client,
        Err(e) => {
            for m in members {
                let _ = m.reply.send(Done::Failed(e.copied()));
            }
            return;
        }
    };
    if members.len() == 1 {
        let m = members.pop().expect("one");
        let completing =
            again_if_it_lost_a_race(|| store.complete_on(&client, &m.lease, &m.response, m.ttl));
        let completed = client.answer(completing).await;
        client.done(&completed);
        let _ = m.reply.send(match completed {
            Ok(fenced) => Done::Kept(fenced),
            Err(e) => Done::Failed(e),
        });
        return;
    }
    let scopes: Vec<&str> = members.iter().map(|m| m.lease.scope.as_str()).collect();
    let keys: Vec<&str> = members.iter().map(|m| &*m.lease.key).collect();
    let tokens: Vec<i64> = members.iter().map(|m| m.lease.token.get()).collect();
    let statuses: Vec<i16> = members
        .iter()
        .map(|m| m.response.status.as_u16() as i16)
        .collect();
    let encoded: Vec<bytes::Bytes> = members
        .iter()
        .map(|m| StoredResponse::encode_headers(&m.response.headers))
        .collect();
    let headers: Vec<&[u8]> = encoded.iter().map(|h| &h[..]).collect();
    let bodies: Vec<&[u8]> = members.iter().map(|m| &m.response.body[..]).collect();
    let ttls: Vec<i64> = members.iter().map(|m| ms(m.ttl)).collect();
    let ids: Vec<String> = members
        .iter()
        .map(|m| store.key_id(&m.lease.scope, &m.lease.key))
        .collect();
    let channel = store.listener.channel();
    let params: [&(dyn ToSql + Sync); 9] = [
        &scopes, &keys, &tokens, &statuses, &headers, &bodies, &ttls, &ids, &channel,
    ];
    let sent = client
        .answer(store.query_on(&client, &store.sql.complete_batch, &params))
        .await;
    client.done(&sent);
    match sent {
        Ok(rows) => {
            let mut kept = vec![false; members.len()];
            for row in rows {
                let at = row
                    .try_get::<_, i64>(0)
                    .ok()
                    .and_then(|n| usize::try_from(n).ok())
                    .and_then(|n| n.checked_sub(1));
                if let Some(place) = at.and_then(|at| kept.get_mut(at)) {
                    *place = true;
                }
            }
            for (m, kept) in members.into_iter().zip(kept) {
                let _ = m.reply.send(Done::Kept(Fenced::kept_if(kept)));
            }
        }
        Err(e) if lost_its_connection(&e) => {
            let mut first = Some(e);
            for m in members {
                let e = first.take().unwrap_or_else(|| {
                    StoreError::new(
                        StoreErrorKind::Unavailable,
                        "the completion's connection was lost",
                    )
                });
                let _ = m.reply.send(Done::Failed(e));
            }
        }
        Err(e) => {
            tracing::debug!(error = %e, completions = members.len(), "a batch of completions failed; each completes alone");
            for m in members {
                let _ = m.reply.send(Done::Alone);
            }
        }
    }
}

impl PostgresStore {
    /// Completes in a batch (`with_batched_claims`).
    pub(super) async fn complete_batched(
        &self,
        completions: &Arc<Completions>,
        lease: &Lease,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<Fenced, StoreError> {
        let arrived = Instant::now();
        let done = self
            .complete_in_a_batch(completions, lease, response, ttl)
            .await;
        let now = Instant::now();
        completions.in_flight.record(now - arrived, now);
        done
    }

    async fn complete_in_a_batch(
        &self,
        completions: &Arc<Completions>,
        lease: &Lease,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<Fenced, StoreError> {
        let (reply, answer) = oneshot::channel();
        let member = || Member {
            lease: lease.clone(),
            response: response.clone(),
            ttl,
            reply,
        };
        let slot = completions.pick();
        if completions.lead_or_queue(slot, member) {
            // Alone, in this task, as without batching; the completions that come
            // meanwhile queue behind it.
            let mut lead = Lead::new(self, completions, slot);
            completions.in_flight.sent();
            let completing = std::pin::pin!(self.complete_alone(lease, response, ttl));
            return lead.run(completing).await;
        }
        match answer.await {
            Ok(Done::Kept(fenced)) => Ok(fenced),
            Ok(Done::Failed(e)) => Err(e),
            Ok(Done::Alone) => self.complete_alone(lease, response, ttl).await,
            Err(_) => Err(StoreError::new(
                StoreErrorKind::Unavailable,
                "the completion's batch ended without an answer",
            )),
        }
    }

    /// Completes on a connection of its own, as without batching.
    pub(super) async fn complete_alone(
        &self,
        lease: &Lease,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<Fenced, StoreError> {
        let client = self.running_client().await?;
        let completing =
            again_if_it_lost_a_race(|| self.complete_on(&client, lease, response, ttl));
        let completed = client.answer(completing).await;
        client.done(&completed);
        completed
    }
}
