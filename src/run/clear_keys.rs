//! Records written before the layer had encryption keys: stored under the client's key
//! in clear, where a claim under the key's hash does not find them. While the keys
//! accept clear records ([`accept_clear_records`]), a claim that took its key new under
//! the hash looks the key up in clear too, so that a request that ran, or runs, before
//! encryption was turned on is answered from there (replayed, `409`, `422`) and not run
//! again.
//!
//! Only a claim that took its key pays for it (one primary-key read): a replay, a `409`
//! or a `422` found under the hash costs nothing more, nor does a layer without keys or
//! one told that no clear record is left.
//!
//! [`accept_clear_records`]: crate::encryption::EncryptionKeys::accept_clear_records

use std::{sync::Arc, time::Duration};

use crate::{
    Fingerprint, Scope,
    run::sealing::Sealing,
    store::{Claim, KeyRecord, KeyState, Store, StoreError, within},
};

/// What the clear key holds that stands in the request's way, as a claim that found it
/// would say; `None` to run the request (or when `sealing` looks nothing up).
pub(crate) async fn standing(
    sealing: &Sealing,
    store: &Arc<dyn Store>,
    scope: &Scope,
    key: &str,
    fingerprint: Fingerprint,
    bound: Duration,
) -> Result<Option<Claim>, StoreError> {
    if !sealing.looks_up_clear_keys() {
        return Ok(None);
    }
    let record = within(
        bound,
        "a look-up of the key in clear",
        store.look_up(scope, key),
    )
    .await;
    looked_up(record, fingerprint)
}

/// [`standing`], read on `conn`, in the transaction that holds the claim (a record
/// another transaction has not committed is not seen).
#[cfg(feature = "postgres")]
pub(crate) async fn standing_in_transaction(
    sealing: &Sealing,
    store: &crate::store::PostgresStore,
    conn: &crate::store::transaction::Checkout,
    scope: &Scope,
    key: &str,
    fingerprint: Fingerprint,
    bound: Duration,
) -> Result<Option<Claim>, StoreError> {
    if !sealing.looks_up_clear_keys() {
        return Ok(None);
    }
    let looking = store.look_up_on(conn, scope, key);
    let record = within(bound, "a look-up of the key in clear", looking).await;
    looked_up(record, fingerprint)
}

/// Logs a failed look-up, as the caller answers it (nothing run).
pub(crate) fn failed(e: &StoreError) {
    crate::observe::store_failed("look_up");
    tracing::error!(
        error = %e,
        "looking the key up in clear (a record from before encryption) failed; nothing was run"
    );
}

fn looked_up(
    record: Result<Option<KeyRecord>, StoreError>,
    fingerprint: Fingerprint,
) -> Result<Option<Claim>, StoreError> {
    let standing = stands(record?, fingerprint);
    if standing.is_some() {
        tracing::debug!(
            "the key holds a record stored in clear, from before encryption; answered from there"
        );
    }
    Ok(standing)
}

/// What a record found under the clear key means for a request of `fingerprint`, as a
/// claim that found it would say; `None` when nothing stops the request from running:
/// no record, one a claim would take afresh (past its TTL), or a lapsed lease of the
/// same request, which a claim would take over and run again.
fn stands(record: Option<KeyRecord>, fingerprint: Fingerprint) -> Option<Claim> {
    let record = record?;
    if record.is_free() {
        return None;
    }
    match record.state {
        KeyState::Running { lease_left }
            if lease_left.is_zero() && record.fingerprint == fingerprint =>
        {
            None
        }
        KeyState::Running { lease_left } => Some(Claim::Running {
            fingerprint: record.fingerprint,
            retry_after: lease_left,
        }),
        KeyState::Completed { response } => Some(Claim::Completed {
            fingerprint: record.fingerprint,
            response,
        }),
    }
}
