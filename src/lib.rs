// The README's links to the guides point at `docs/` in the repository; here, the same
// links (the first definition of a label wins) point at the guides' pages.
#![doc = "[problems]: crate::rejection"]
#![doc = "[failure-modes]: crate::guide::failure_modes"]
#![doc = "[modes]: crate::guide::modes"]
#![doc = "[security]: crate::guide::security"]
#![doc = "[observability]: crate::guide::observability"]
#![doc = "[postgres]: crate::guide::postgres"]
#![doc = "[clients]: crate::guide::clients"]
#![doc = "[standards]: crate::guide::standards"]
#![doc = "[production]: crate::guide::production"]
#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod answers;
mod body;
mod catch_panic;
pub mod encryption;
#[cfg(feature = "axum")]
mod extract;
mod future;
pub mod guide;
mod hex;
pub mod job;
mod layer;
#[cfg(feature = "metrics")]
pub mod metrics;
mod observe;
mod outcome;
mod policy;
mod random;
mod record;
pub mod rejection;
mod request;
mod rfc3339;
mod run;
mod service;
mod settings;
mod shutdown;
pub mod store;
#[cfg(feature = "postgres")]
pub mod transactional;

pub use answers::IDEMPOTENT_REPLAYED;
pub use body::{BoxError, ResponseBody};
#[cfg(feature = "axum")]
pub use extract::MissingIdempotencyKey;
pub use future::ResponseFuture;
pub use layer::IdempotencyLayer;
pub use outcome::Outcome;
pub use policy::{NoStore, default_storage_policy};
pub use record::StoredResponse;
pub use request::fingerprint::{Fingerprint, FingerprintScheme, fingerprint};
pub use request::key::{IDEMPOTENCY_KEY, IdempotencyKey, KeyError, MAX_KEY_LEN, parse_key};
pub use request::principal::Principal;
pub use request::scope::Scope;
pub use run::steps::StepError;
pub use service::Idempotency;
pub use shutdown::ShutdownHandle;

/// The `deadpool-postgres` this crate is built with: build the pool you hand to
/// [`IdempotencyLayer::new`] or [`IdempotencyLayer::transactional`] with it, and write
/// repository code against its [`GenericClient`](deadpool_postgres::GenericClient), so
/// that the app's pool and the layer's are one type without matching versions by hand.
///
/// ```no_run
/// use tower_idempotency::{IdempotencyLayer, deadpool_postgres, tokio_postgres};
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let mut config = deadpool_postgres::Config::new();
/// config.url = Some("postgres://app@127.0.0.1/payments".into());
/// let pool = config.create_pool(
///     Some(deadpool_postgres::Runtime::Tokio1),
///     tokio_postgres::NoTls,
/// )?;
/// let layer = IdempotencyLayer::transactional(pool);
/// layer.migrate().await?;
/// # Ok(()) }
/// ```
#[cfg(feature = "postgres")]
pub use deadpool_postgres;
/// The `tokio-postgres` this crate is built with (the driver under
/// [`deadpool_postgres`]): its `NoTls`, types and errors, at the version the store's
/// connections use.
#[cfg(feature = "postgres")]
pub use tokio_postgres;
