//! A step recorded under a running key: what [`Store::steps`](super::Store::steps)
//! reads and [`Store::record_step`](super::Store::record_step) writes.

use bytes::Bytes;

/// One step of a key's handler, as recorded: its place in the handler's order, its
/// name, and its result as the handler serialised it (JSON, by
/// [`IdempotencyKey::step`](crate::IdempotencyKey::step)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordedStep {
    /// Its place, from 0.
    pub n: u32,
    /// Its name, as the handler gave it.
    pub name: String,
    /// Its result.
    pub result: Bytes,
}

/// A resumable key whose holder is gone ([`Store::orphans`](super::Store::orphans)): a
/// completer takes it over and runs its handler with the request stored for it.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Orphan {
    /// The scope of the key.
    pub scope: crate::Scope,
    /// The key, as stored.
    pub key: String,
    /// The fingerprint of the request that claimed it.
    pub fingerprint: crate::Fingerprint,
    /// The request, as the layer stored it.
    pub request: Bytes,
}

impl Orphan {
    /// An orphan, as a store found it.
    pub fn new(
        scope: crate::Scope,
        key: impl Into<String>,
        fingerprint: crate::Fingerprint,
        request: Bytes,
    ) -> Self {
        Self {
            scope,
            key: key.into(),
            fingerprint,
            request,
        }
    }
}
