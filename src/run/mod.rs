//! The engine: how the work under a claimed key runs, whichever way the key came — a
//! request in lease mode ([`lease`]), a request in transactional mode
//! ([`transactional`]), or a job ([`JobRunner`](crate::job::JobRunner)).
//!
//! - [`decision`]: what a claim means for the request that made it: run, replay, wait
//!   or refuse;
//! - [`handler`]: the inner service called, and its response read within bounds;
//! - [`renewal`], [`storing`], [`release`]: a lease kept while the work runs, its
//!   result stored, its key released, each tried again while the store is away;
//! - [`sealing`]: responses sealed before they are stored and opened before they are
//!   replayed, keys hashed;
//! - [`completer`]: resumable keys left running by a process that died, finished by a
//!   live one;
//! - [`steps`]: a handler's recorded steps, each run once per key, replayed to a
//!   later run of the key;
//! - [`previous`]: a key new in its (scope, stored key) looked for where the layer's
//!   earlier settings stored it: under the scope it used before a deploy changed it,
//!   and in clear, from before encryption.

use std::{sync::Arc, time::Duration};

use crate::store::Store;

pub(crate) mod completer;
pub(crate) mod decision;
pub(crate) mod handler;
pub(crate) mod job;
pub(crate) mod lease;
pub(crate) mod previous;
pub(crate) mod release;
pub(crate) mod renewal;
pub(crate) mod sealing;
pub(crate) mod steps;
pub(crate) mod storing;
#[cfg(feature = "postgres")]
pub(crate) mod transactional;

/// What a run under a lease needs from its owner (the layer, or a `JobRunner`): the
/// store, how long a lease holds, how long a result is kept, and how long the store
/// may take to answer.
#[derive(Clone)]
pub(crate) struct Leased {
    pub(crate) store: Arc<dyn Store>,
    pub(crate) lease: Duration,
    pub(crate) ttl: Duration,
    pub(crate) store_timeout: Duration,
    /// Seals what is stored, if the owner has keys.
    pub(crate) sealing: sealing::Sealing,
    /// Renews the leases of the owner's running claims.
    pub(crate) renewals: renewal::Renewals,
}
