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
