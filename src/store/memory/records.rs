//! The memory store's records: what each holds, what it costs in bytes, and how the
//! store keeps them within its bound (sweeping expired ones, reducing completed ones
//! whose response expired to remembered ones, evicting remembered ones and then
//! completed ones, soonest to expire first).

use std::{
    cmp::Reverse,
    collections::{BTreeSet, BinaryHeap, HashMap, hash_map::Entry as MapEntry},
    mem::size_of,
    sync::Arc,
    time::{Duration, Instant, SystemTime},
};

use bytes::Bytes;
use http::StatusCode;

use crate::{
    Fingerprint, Scope, StoredResponse,
    store::{FencingToken, StoreError, StoreErrorKind},
};

/// A record's key: its scope and its key.
pub(super) type Id = (Scope, Arc<str>);

/// A time, in nanoseconds since the store was made: half the size of an `Instant`.
pub(super) type At = u64;

pub(super) struct Inner {
    /// Each record boxed: a map whose keys come and go sits at up to twice the slots
    /// its records fill, and a slot is then a third of what it would be.
    pub(super) records: HashMap<Id, Box<Record>>,
    /// The scopes of the records, each with how many records it has: every record of a
    /// scope shares its name, whichever request brought it.
    pub(super) scopes: HashMap<Scope, usize>,
    /// The running records, by the time they become free (their TTL has passed and
    /// their lease lapsed; a live holder renews it), soonest first: one entry each,
    /// taken out when the record completes, is released or renewed.
    pub(super) running: BTreeSet<(At, Id)>,
    /// The completed records by expiry, soonest first: the order of both the sweep and
    /// eviction. A record's entry is the one at its `expires_at`; others are stale (the
    /// record went, or was claimed afresh), dropped when they come to the front, or all
    /// at once when they outnumber the records.
    pub(super) expiry: BinaryHeap<Reverse<(At, Id)>>,
    /// The remembered records by the time they are forgotten, soonest first, with
    /// stale entries as `expiry` has them: the order of their sweep and of their
    /// eviction, which comes before any completed record's.
    pub(super) remembered: BinaryHeap<Reverse<(At, Id)>>,
    /// How long a completed record is remembered once its response expired (nanos;
    /// 0: not at all).
    pub(super) remember: At,
    /// Remembered records evicted to make room.
    pub(super) evicted_remembered: u64,
    /// The bytes the records are counted for (see [`RECORD_BYTES`]).
    pub(super) bytes: usize,
    pub(super) max_entries: usize,
    pub(super) max_bytes: usize,
    /// Completed records evicted to make room.
    pub(super) evicted: u64,
    pub(super) epoch: Instant,
    /// The time of day at `epoch`: a record's times, for an operator, are read from it.
    pub(super) wall_epoch: SystemTime,
    /// The steps recorded under running keys (`steps`), forgotten with the key's
    /// record, its completion, or its taking by another request. Not counted in
    /// `bytes`: they live only while their key runs.
    pub(super) steps: HashMap<Id, Vec<crate::store::RecordedStep>>,
}

/// How many records a claim looks at, at most, to sweep them before it runs.
pub(super) const SWEPT_PER_CLAIM: usize = 64;

/// What a record is counted for besides its key and its stored response: its slot in
/// the map at the map's fullest (seven slots in eight used), the record itself, its
/// entry in a queue, its key's reference counts, and the allocator's headers.
pub(super) const RECORD_BYTES: usize = (size_of::<(Id, Box<Record>)>() + 1) * 8 / 7
    + size_of::<Record>()
    + ALLOCATION
    + size_of::<(At, Id)>()
    + ARC_COUNTS
    + ALLOCATION;

/// What a stored response is counted for besides its status, encoded headers and body:
/// the reference counts and allocator's header of their one allocation.
pub(super) const STORED_BYTES: usize = ARC_COUNTS + ALLOCATION;

/// What a scope is counted for, once for all of its records, besides its name.
pub(super) const SCOPE_BYTES: usize =
    (size_of::<(Scope, usize)>() + 1) * 8 / 7 + ARC_COUNTS + ALLOCATION;

/// The strong and weak counts at the start of an `Arc`'s allocation.
pub(super) const ARC_COUNTS: usize = 2 * size_of::<usize>();

/// The allocator's header of an allocation and its rounding, on average.
pub(super) const ALLOCATION: usize = 16;

pub(super) struct Record {
    pub(super) fingerprint: Fingerprint,
    pub(super) token: FencingToken,
    pub(super) expires_at: At,
    /// When the claim that holds or completed it was taken (a takeover: when it took
    /// the key over), for an operator's look-up.
    pub(super) claimed_at: At,
    pub(super) state: State,
}

pub(super) enum State {
    /// Held by a claim until `locked_until`.
    Running {
        locked_until: At,
    },
    Completed(Stored),
    /// Completed, its response gone: what a late retry is refused with. `expires_at`
    /// is then when the record is forgotten.
    Remembered {
        status: StatusCode,
        completed_at: At,
    },
}

/// A stored response in one allocation: the encoded headers, then the body.
#[derive(Clone)]
pub(super) struct Stored {
    pub(super) status: StatusCode,
    /// Where the headers end and the body begins (the headers of a response are far
    /// below 4 GiB, which would not decode, and replay as corrupt).
    pub(super) split: u32,
    pub(super) bytes: Arc<[u8]>,
    /// When it was stored, for an operator's look-up (set as it is, under the lock).
    pub(super) completed_at: At,
}

impl Stored {
    /// `response`, encoded.
    pub(super) fn new(response: &StoredResponse) -> Self {
        let headers = StoredResponse::encode_headers(&response.headers);
        let mut bytes = Vec::with_capacity(headers.len() + response.body.len());
        bytes.extend_from_slice(&headers);
        bytes.extend_from_slice(&response.body);
        Self {
            status: response.status,
            split: u32::try_from(headers.len()).unwrap_or(u32::MAX),
            bytes: Arc::from(bytes),
            completed_at: 0,
        }
    }

    /// The response to replay; the body shares the stored bytes.
    pub(super) fn response(&self) -> Result<StoredResponse, StoreError> {
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
    /// Past its TTL and not held by a live lease, and, completed, past the time it is
    /// remembered after its TTL, `remember`: it may be purged or claimed afresh.
    pub(super) fn is_free(&self, now: At, remember: At) -> bool {
        match self.state {
            State::Completed(_) => self.expires_at.saturating_add(remember) <= now,
            _ => self.free_at() <= now,
        }
    }

    /// When it becomes free, its response aside: at its expiry (a remembered one's:
    /// when it is forgotten), or when its lease lapses if that is later.
    pub(super) fn free_at(&self) -> At {
        match self.state {
            State::Completed(_) | State::Remembered { .. } => self.expires_at,
            State::Running { locked_until } => self.expires_at.max(locked_until),
        }
    }

    /// The bytes a record of `key` is counted for (its scope's aside).
    pub(super) fn cost(&self, key: &str) -> usize {
        RECORD_BYTES
            + key.len()
            + match &self.state {
                State::Running { .. } | State::Remembered { .. } => 0,
                State::Completed(stored) => STORED_BYTES + stored.bytes.len(),
            }
    }
}

/// `now + d`, saturating in some 580 years instead of overflowing.
pub(super) fn later(now: At, d: Duration) -> At {
    now.saturating_add(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

impl Inner {
    pub(super) fn new() -> Self {
        Self {
            records: HashMap::new(),
            scopes: HashMap::new(),
            running: BTreeSet::new(),
            expiry: BinaryHeap::new(),
            remembered: BinaryHeap::new(),
            remember: later(0, crate::store::DEFAULT_REMEMBER),
            evicted_remembered: 0,
            bytes: 0,
            max_entries: super::MemoryStore::DEFAULT_MAX_ENTRIES,
            max_bytes: super::MemoryStore::DEFAULT_MAX_BYTES,
            evicted: 0,
            epoch: Instant::now(),
            wall_epoch: SystemTime::now(),
            steps: HashMap::new(),
        }
    }

    pub(super) fn now(&self) -> At {
        u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    /// `at` as a time of day, by the store's clock: the time of day it was made, and
    /// the time since, so that the same `at` always reads the same.
    pub(super) fn wall(&self, at: At) -> SystemTime {
        self.wall_epoch + Duration::from_nanos(at)
    }

    /// The store's own copy of `scope`, counted for one more record.
    pub(super) fn scope(&mut self, scope: &Scope) -> Scope {
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
    pub(super) fn drop_scope(&mut self, scope: &Scope) {
        if let Some(count) = self.scopes.get_mut(scope) {
            *count -= 1;
            if *count == 0 {
                self.scopes.remove(scope);
                self.bytes -= SCOPE_BYTES + scope.as_str().len();
            }
        }
    }

    /// The bytes a new record of `id` adds: its own, and its scope's if it is the first.
    pub(super) fn cost_of_new(&self, id: &Id, record: &Record) -> usize {
        let scope = if self.scopes.contains_key(&id.0) {
            0
        } else {
            SCOPE_BYTES + id.0.as_str().len()
        };
        record.cost(&id.1) + scope
    }

    /// Adds a running record for a key that has none, with the store's copy of its
    /// scope.
    pub(super) fn insert(&mut self, id: Id, record: Record) {
        self.steps.remove(&id);
        let id = (self.scope(&id.0), id.1);
        self.bytes += record.cost(&id.1);
        self.running.insert((record.free_at(), id.clone()));
        self.records.insert(id, Box::new(record));
    }

    /// Removes `id`'s record, if any; its entry, its bytes, and its scope's with its last
    /// record, go with it.
    pub(super) fn remove(&mut self, id: &Id) -> bool {
        let Some((id, record)) = self.records.remove_entry(id) else {
            return false;
        };
        self.steps.remove(&id);
        if let State::Running { .. } = record.state {
            self.running.remove(&(record.free_at(), id.clone()));
        }
        self.bytes -= record.cost(&id.1);
        self.drop_scope(&id.0);
        true
    }

    /// Changes `id`'s running record with `f`, keeping its entry in `running` in step.
    /// `false` if `id` has no running record.
    pub(super) fn update_running(&mut self, id: &Id, f: impl FnOnce(&mut Record)) -> bool {
        let Some(r) = self.records.get_mut(id) else {
            return false;
        };
        if !matches!(r.state, State::Running { .. }) {
            return false;
        }
        let key = (r.free_at(), id.clone());
        let was = self.running.take(&key);
        let fingerprint = r.fingerprint;
        f(r);
        // Completed, or taken by another request: its steps are no longer of use.
        if !matches!(r.state, State::Running { .. }) || r.fingerprint != fingerprint {
            self.steps.remove(id);
        }
        let Some(r) = self.records.get_mut(id) else {
            return true;
        };
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
    pub(super) fn compact(&mut self) {
        let done = self.records.len() - self.running.len();
        if self.expiry.len() + self.remembered.len() > 2 * done + SWEPT_PER_CLAIM {
            let (mut expiry, mut remembered) = (Vec::new(), Vec::new());
            for (id, r) in &self.records {
                match r.state {
                    State::Completed(_) => expiry.push(Reverse((r.expires_at, id.clone()))),
                    State::Remembered { .. } => {
                        remembered.push(Reverse((r.expires_at, id.clone())));
                    }
                    State::Running { .. } => {}
                }
            }
            self.expiry = expiry.into();
            self.remembered = remembered.into();
        }
    }

    /// Whether `entry` is the own entry of a remembered record in `remembered`.
    pub(super) fn is_remembered_at(&self, entry: &Reverse<(At, Id)>) -> bool {
        let Reverse((at, id)) = entry;
        matches!(
            self.records.get(id),
            Some(r) if r.expires_at == *at && matches!(r.state, State::Remembered { .. })
        )
    }

    /// Reduces `id`'s completed record, whose response expired, to a remembered one:
    /// its response dropped, its status and completion time kept, forgotten at its
    /// expiry plus `remember`. Removes it instead if that time has passed at `now`.
    pub(super) fn reduce(&mut self, id: &Id, now: At) {
        let remember = self.remember;
        let Some(r) = self.records.get_mut(id) else {
            return;
        };
        let State::Completed(stored) = &r.state else {
            return;
        };
        let forget_at = r.expires_at.saturating_add(remember);
        if forget_at <= now {
            self.remove(id);
            return;
        }
        self.bytes -= STORED_BYTES + stored.bytes.len();
        r.state = State::Remembered {
            status: stored.status,
            completed_at: stored.completed_at,
        };
        r.expires_at = forget_at;
        self.remembered.push(Reverse((forget_at, id.clone())));
    }

    /// Whether `entry` is the own entry of a completed record in `expiry`.
    pub(super) fn is_completed_at(&self, entry: &Reverse<(At, Id)>) -> bool {
        let Reverse((at, id)) = entry;
        matches!(
            self.records.get(id),
            Some(r) if r.expires_at == *at && matches!(r.state, State::Completed(_))
        )
    }

    /// Removes records that are free at `now`, looking at up to `looked` entries and
    /// removing up to `removed`; returns how many it removed.
    pub(super) fn sweep(&mut self, now: At, looked: usize, removed: usize) -> usize {
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
            let due = |heap: &BinaryHeap<Reverse<(At, Id)>>| match heap.peek() {
                Some(Reverse((at, _))) if *at <= now => Some(*at),
                _ => None,
            };
            match (due(&self.expiry), due(&self.remembered)) {
                // A remembered record, forgotten.
                (expiring, Some(forgotten)) if expiring.is_none_or(|at| forgotten <= at) => {
                    let Some(entry) = self.remembered.pop() else {
                        break;
                    };
                    if self.is_remembered_at(&entry) {
                        self.remove(&entry.0.1);
                        gone += 1;
                    }
                }
                // A completed record whose response expired: remembered, or removed.
                (Some(_), _) => {
                    let Some(entry) = self.expiry.pop() else {
                        break;
                    };
                    if self.is_completed_at(&entry) {
                        self.reduce(&entry.0.1, now);
                        gone += 1;
                    }
                }
                _ => break,
            }
        }
        gone
    }

    /// Evicts remembered records, soonest to be forgotten first, then completed
    /// records, soonest to expire first and never `keep`'s, until `entries` more
    /// records of `bytes` more bytes fit within the bounds; `false` when they do not,
    /// and only running claims (and `keep`) are left to evict.
    ///
    /// Remembered records go first: a retry while a response is kept is far likelier
    /// than one after it, and a completed record evicted loses both its replay and the
    /// memory of its key.
    pub(super) fn make_room(&mut self, entries: usize, bytes: usize, keep: Option<&Id>) -> bool {
        let mut kept = None;
        let fits = loop {
            if self.records.len() + entries <= self.max_entries
                && self.bytes + bytes <= self.max_bytes
            {
                break true;
            }
            if let Some(entry) = self.remembered.pop() {
                if self.is_remembered_at(&entry) {
                    self.remove(&entry.0.1);
                    self.evicted_remembered += 1;
                }
                continue;
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

    pub(super) fn full(&self) -> StoreError {
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
