#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_auto_cfg))]

mod body;
mod catch_panic;
mod fingerprint;
pub mod job;
mod key;
mod layer;
mod outcome;
mod policy;
mod record;
pub mod rejection;
mod release;
mod renewal;
mod scope;
mod service;
mod shutdown;
pub mod store;
#[cfg(feature = "postgres")]
pub mod transactional;

pub use body::{BoxError, ResponseBody};
pub use fingerprint::{Fingerprint, fingerprint};
#[cfg(feature = "axum")]
pub use key::MissingIdempotencyKey;
pub use key::{IdempotencyKey, KeyError, MAX_KEY_LEN, parse_key};
pub use layer::{IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED, IdempotencyLayer};
pub use outcome::Outcome;
pub use policy::{NoStore, default_storage_policy};
pub use record::StoredResponse;
pub use scope::Scope;
pub use service::{Idempotency, ResponseFuture};
pub use shutdown::ShutdownHandle;

/// The examples in `docs/` are compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../docs/failure-modes.md")]
struct FailureModesDoctests;

#[cfg(doctest)]
#[doc = include_str!("../docs/modes.md")]
struct ModesDoctests;

#[cfg(doctest)]
#[doc = include_str!("../docs/security.md")]
struct SecurityDoctests;

#[cfg(doctest)]
#[doc = include_str!("../docs/postgres.md")]
struct PostgresDoctests;

#[cfg(doctest)]
#[doc = include_str!("../docs/clients.md")]
struct ClientsDoctests;
