//! A key's life on demand: what support asks ("what happened to key X?") and what an
//! operator does about a key a bug left running.
//!
//! [`Operator`] runs each action on any [`Store`] and logs it at `info`, with the
//! hashes of the key and its scope (the same 16 hex digits the layer's `idempotency`
//! span shows for them), never either in clear. The stores do the work, each action one
//! step: [`Store::look_up`], [`Store::running_keys`], [`Store::release_running`],
//! [`Store::delete_completed`]. `examples/keys.rs` is a command-line tool over it.

use std::{sync::Arc, time::Duration};

use super::{FencingToken, IntoStore, KeyRecord, KeyState, Store, StoreError};
use crate::{Scope, request::short_hash};

/// A running key, as [`Store::running_keys`] lists it.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct RunningKey {
    /// Its scope.
    pub scope: Scope,
    /// The key, as the store keeps it.
    pub key: String,
    /// Its record: its holder's token, the lease left, when it was claimed.
    pub record: KeyRecord,
}

impl RunningKey {
    /// The running `key` in `scope`, with its `record`: for a store of the app's own.
    pub fn new(scope: Scope, key: String, record: KeyRecord) -> Self {
        Self { scope, key, record }
    }
}

/// What an operator's release or deletion of one key did.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum Removal {
    /// The record held (or completed) under `token` is gone: a retry with the key
    /// claims it afresh, and runs.
    Removed {
        /// The token of the claim removed: a holder that shows it is refused from now
        /// on.
        token: FencingToken,
    },
    /// The key has no record (never claimed, released, purged; or claimed in a
    /// transaction not committed yet): nothing to do.
    Absent,
    /// The record is not one the action removes (a completed key for a release, a
    /// running one for a deletion, a key held under another token than the one given),
    /// or it changed as it was being removed: nothing changed. The record as it is.
    Refused(Box<KeyRecord>),
}

/// An operator's actions on keys, over any [`Store`], each logged at `info` with the
/// hashes of the key and its scope (the same 16 hex digits the layer's `idempotency`
/// span shows for them), never either in clear. The stores do the work, each action
/// one step: [`Store::look_up`], [`Store::running_keys`], [`Store::release_running`],
/// [`Store::delete_completed`]. `examples/keys.rs` is a command-line tool over it.
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::{
///     Fingerprint, Principal,
///     store::{Claim, ClaimRequest, Fenced, MemoryStore, Operator, Removal, Store},
/// };
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let store = MemoryStore::new();
/// let scope = Principal::new("acct_42").scope().clone(); // "principal:acct_42"
/// let request = ClaimRequest {
///     scope: &scope,
///     key: "order-1",
///     fingerprint: Fingerprint::new([1; 32]),
///     lease: Duration::from_secs(30),
///     ttl: Duration::from_secs(3600),
/// };
/// let Claim::Acquired(lease) = store.claim(&request).await? else { panic!("a new key") };
///
/// let operator = Operator::new(store.clone());
/// let stuck = operator.running(Duration::ZERO, 100).await?;
/// assert_eq!(stuck[0].key, "order-1");
/// let record = operator.look_up(&scope, "order-1").await?.expect("claimed");
/// // Released under the token the look-up showed: nothing else is touched.
/// let released = operator.release(&scope, "order-1", Some(record.token)).await?;
/// assert!(matches!(released, Removal::Removed { token } if token == lease.token));
/// // Its holder can no longer store anything under the key; a retry runs it anew.
/// let response = tower_idempotency::StoredResponse {
///     status: http::StatusCode::OK, headers: Default::default(), body: "late".into(),
/// };
/// assert_eq!(store.complete(&lease, &response, request.ttl).await?, Fenced::LeaseLost);
/// assert!(matches!(store.claim(&request).await?, Claim::Acquired(_)));
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Operator {
    store: Arc<dyn Store>,
}

impl std::fmt::Debug for Operator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Operator").finish_non_exhaustive()
    }
}

impl Operator {
    /// The actions on `store`'s keys: a [`Store`], the `Arc<dyn Store>` a layer shares,
    /// or a pool.
    pub fn new(store: impl IntoStore) -> Self {
        Self {
            store: store.into_store(),
        }
    }

    /// The hash by which the layer's logs and this operator's name a key or a scope:
    /// the first 16 hex digits of its SHA-256. Look for it in the logs.
    ///
    /// ```
    /// use tower_idempotency::store::Operator;
    ///
    /// assert_eq!(Operator::hash("order-1").len(), 16);
    /// ```
    pub fn hash(text: &str) -> String {
        short_hash(text.as_bytes()).as_str().to_owned()
    }

    /// The record of `key` in `scope` ([`Store::look_up`]): running (its holder's
    /// token, the lease left) or completed (its response: status, headers and body),
    /// when it was claimed and completed, how long it is kept. `None`: no record.
    ///
    /// # Errors
    ///
    /// The store could not be reached, failed, or cannot look keys up.
    pub async fn look_up(&self, scope: &Scope, key: &str) -> Result<Option<KeyRecord>, StoreError> {
        let found = self.store.look_up(scope, key).await;
        let (key_hash, scope_hash) = hashes(scope, key);
        match &found {
            Ok(record) => tracing::info!(
                key_hash = key_hash.as_str(),
                scope_hash = scope_hash.as_str(),
                found = record.as_ref().map_or("absent", state),
                token = record.as_ref().map(|r| r.token.get()),
                "an operator looked an idempotency key up"
            ),
            Err(e) => failed("look-up", &key_hash, &scope_hash, e),
        }
        found
    }

    /// The running keys claimed at least `older_than` ago, oldest first, at most
    /// `limit` ([`Store::running_keys`], which says what it costs).
    ///
    /// # Errors
    ///
    /// The store could not be reached, failed, or cannot list running keys.
    pub async fn running(
        &self,
        older_than: Duration,
        limit: usize,
    ) -> Result<Vec<RunningKey>, StoreError> {
        let listed = self.store.running_keys(older_than, limit).await;
        match &listed {
            Ok(keys) => tracing::info!(
                older_than_secs = older_than.as_secs_f64(),
                limit,
                found = keys.len(),
                "an operator listed the idempotency keys running longer than a bound"
            ),
            Err(e) => tracing::warn!(
                older_than_secs = older_than.as_secs_f64(),
                limit,
                error = %e,
                "an operator's list of running idempotency keys failed"
            ),
        }
        listed
    }

    /// Frees the running `key` in `scope`, fenced: its holder can no longer complete,
    /// renew or release it, and a retry runs it anew ([`Store::release_running`], which
    /// says what the holder's client gets). With `holder`, only if that token still
    /// holds it: pass the token a [`look_up`](Self::look_up) showed.
    ///
    /// # Errors
    ///
    /// The store could not be reached, failed, or cannot release keys this way; the
    /// claim may still be there.
    pub async fn release(
        &self,
        scope: &Scope,
        key: &str,
        holder: Option<FencingToken>,
    ) -> Result<Removal, StoreError> {
        let released = self.store.release_running(scope, key, holder).await;
        let (key_hash, scope_hash) = hashes(scope, key);
        let holder = holder.map(FencingToken::get);
        match &released {
            Ok(Removal::Removed { token }) => tracing::info!(
                key_hash = key_hash.as_str(),
                scope_hash = scope_hash.as_str(),
                token = token.get(),
                "an operator released a running idempotency key: its holder is fenced off, and a retry runs it anew"
            ),
            Ok(other) => tracing::info!(
                key_hash = key_hash.as_str(),
                scope_hash = scope_hash.as_str(),
                holder,
                found = found(other),
                "an operator's release of an idempotency key changed nothing"
            ),
            Err(e) => failed("release", &key_hash, &scope_hash, e),
        }
        released
    }

    /// Deletes the completed `key` in `scope`: a retry with it runs again
    /// ([`Store::delete_completed`]). A running key is left alone.
    ///
    /// # Errors
    ///
    /// The store could not be reached, failed, or cannot delete keys this way; the
    /// record may still be there.
    pub async fn delete(&self, scope: &Scope, key: &str) -> Result<Removal, StoreError> {
        let deleted = self.store.delete_completed(scope, key).await;
        let (key_hash, scope_hash) = hashes(scope, key);
        match &deleted {
            Ok(Removal::Removed { token }) => tracing::info!(
                key_hash = key_hash.as_str(),
                scope_hash = scope_hash.as_str(),
                token = token.get(),
                "an operator deleted a completed idempotency key: a retry with it runs again"
            ),
            Ok(other) => tracing::info!(
                key_hash = key_hash.as_str(),
                scope_hash = scope_hash.as_str(),
                found = found(other),
                "an operator's deletion of an idempotency key changed nothing"
            ),
            Err(e) => failed("deletion", &key_hash, &scope_hash, e),
        }
        deleted
    }
}

fn hashes(scope: &Scope, key: &str) -> (String, String) {
    (Operator::hash(key), Operator::hash(scope.as_str()))
}

/// A record's state, as the events name it.
fn state(record: &KeyRecord) -> &'static str {
    match record.state {
        KeyState::Running { .. } => "running",
        KeyState::Completed { .. } => "completed",
        KeyState::Remembered { .. } => "remembered",
    }
}

/// What a removal that changed nothing found, as the events name it.
fn found(removal: &Removal) -> &'static str {
    match removal {
        Removal::Refused(record) => state(record),
        Removal::Absent | Removal::Removed { .. } => "absent",
    }
}

fn failed(action: &str, key_hash: &str, scope_hash: &str, error: &StoreError) {
    tracing::warn!(
        key_hash,
        scope_hash,
        error = %error,
        "an operator's {action} of an idempotency key failed"
    );
}
