//! What a store holds for one key, read without changing it ([`Store::look_up`]): the
//! record a layer in transition looks for under the scope it used before
//! ([`previous_scope_with`](crate::IdempotencyLayer::previous_scope_with)), and what an
//! operator asks when a client says "what happened to my request?"
//! ([`Operator::look_up`](super::Operator::look_up)).

use std::time::{Duration, SystemTime};

use super::FencingToken;
#[cfg(doc)]
use super::Store;
use crate::{Fingerprint, StoredResponse};

/// A key's record as [`Store::look_up`] read it.
///
/// Marked `#[non_exhaustive]`: more of what a store knows may be added; a store of the
/// app's own builds it with [`running`](Self::running) or [`completed`](Self::completed),
/// and says when it was claimed and completed, if it knows, with
/// [`with_claimed_at`](Self::with_claimed_at) and
/// [`with_completed_at`](Self::with_completed_at).
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::{Fingerprint, store::{FencingToken, KeyRecord, KeyState}};
///
/// let record = KeyRecord::running(
///     FencingToken::new(7),
///     Fingerprint::new([0; 32]),
///     Duration::from_secs(20),
///     Duration::from_secs(3600),
/// );
/// assert!(matches!(record.state, KeyState::Running { lease_left } if lease_left.as_secs() == 20));
/// assert!(!record.is_free());
/// assert_eq!(record.claimed_at, None); // not said
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct KeyRecord {
    /// The fencing token of the claim that holds, or completed, the key.
    pub token: FencingToken,
    /// The fingerprint of the request that claimed it.
    pub fingerprint: Fingerprint,
    /// Running, completed with its response, or remembered without it.
    pub state: KeyState,
    /// How long the record is kept from now (its TTL, counted from completion; a
    /// running record lives at least as long as its lease; a remembered one, what is
    /// left of the time it is remembered). Zero: past it, and free for a new claim
    /// once its lease, if it runs, has lapsed; the purge removes it.
    pub expires_in: Duration,
    /// When the claim that holds the key, or completed it, was taken, by the store's
    /// clock (PostgreSQL's `now()` for [`PostgresStore`](super::PostgresStore)); a
    /// takeover of a lapsed lease counts from itself. `None` where a store does not say.
    pub claimed_at: Option<SystemTime>,
    /// When it was completed, by the store's clock; `None` while it runs, or where a
    /// store does not say.
    pub completed_at: Option<SystemTime>,
}

/// The state of a key's record.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum KeyState {
    /// Claimed, and not completed yet.
    Running {
        /// What is left of the holder's lease; zero once it has lapsed (the holder is
        /// presumed dead: a retry with the same request takes the key over).
        lease_left: Duration,
    },
    /// Completed: its response is replayed to a retry with the same request.
    Completed {
        /// The stored response: its status, and the sizes an operator asks for
        /// (`response.body.len()`; the headers as stored,
        /// [`StoredResponse::encode_headers`] of `response.headers`).
        response: StoredResponse,
    },
    /// Completed, its response gone (its TTL has passed), the key remembered: a retry
    /// is refused (`410 response-expired`), never run again. `expires_in` is then what
    /// is left of the time it is remembered; `completed_at` says when it was completed.
    Remembered {
        /// The status of the response it was completed with.
        status: http::StatusCode,
    },
}

impl KeyRecord {
    /// A running record: claimed under `token` by a request of `fingerprint`, its
    /// lease lapsing in `lease_left`, the record kept for `expires_in`.
    pub fn running(
        token: FencingToken,
        fingerprint: Fingerprint,
        lease_left: Duration,
        expires_in: Duration,
    ) -> Self {
        Self {
            token,
            fingerprint,
            state: KeyState::Running { lease_left },
            expires_in,
            claimed_at: None,
            completed_at: None,
        }
    }

    /// A completed record: `response`, stored under `token` for a request of
    /// `fingerprint`, kept for `expires_in`.
    pub fn completed(
        token: FencingToken,
        fingerprint: Fingerprint,
        response: StoredResponse,
        expires_in: Duration,
    ) -> Self {
        Self {
            token,
            fingerprint,
            state: KeyState::Completed { response },
            expires_in,
            claimed_at: None,
            completed_at: None,
        }
    }

    /// A remembered record: completed under `token` by a request of `fingerprint` with
    /// a response of `status` that is gone; remembered for `expires_in` more.
    pub fn remembered(
        token: FencingToken,
        fingerprint: Fingerprint,
        status: http::StatusCode,
        expires_in: Duration,
    ) -> Self {
        Self {
            token,
            fingerprint,
            state: KeyState::Remembered { status },
            expires_in,
            claimed_at: None,
            completed_at: None,
        }
    }

    /// This record, claimed at `at` (see [`claimed_at`](Self::claimed_at)).
    #[must_use]
    pub fn with_claimed_at(mut self, at: SystemTime) -> Self {
        self.claimed_at = Some(at);
        self
    }

    /// This record, completed at `at` (see [`completed_at`](Self::completed_at)).
    #[must_use]
    pub fn with_completed_at(mut self, at: SystemTime) -> Self {
        self.completed_at = Some(at);
        self
    }

    /// Whether the key is running: claimed, and not completed yet.
    pub fn is_running(&self) -> bool {
        matches!(self.state, KeyState::Running { .. })
    }

    /// The stored response, if the key is completed.
    pub fn response(&self) -> Option<&StoredResponse> {
        match &self.state {
            KeyState::Completed { response } => Some(response),
            KeyState::Running { .. } | KeyState::Remembered { .. } => None,
        }
    }

    /// Whether a new claim of the key would take it afresh, as if it had no record:
    /// it is past its TTL and, if running, its lease has lapsed.
    pub fn is_free(&self) -> bool {
        self.expires_in.is_zero()
            && match &self.state {
                KeyState::Running { lease_left } => lease_left.is_zero(),
                KeyState::Completed { .. } | KeyState::Remembered { .. } => true,
            }
    }
}
