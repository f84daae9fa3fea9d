//! The engine's sealing step, the same for lease mode, transactional mode and jobs, and
//! so for every store: a response sealed once before it is stored (every attempt to
//! store it sends the same bytes, so that a completion sent again after its answer was
//! lost compares equal), what a claim found opened before it is replayed, and the key
//! hashed before it reaches the store ([`EncryptionKeys`]).

use std::borrow::Cow;

use bytes::Bytes;

use crate::{
    Scope, StoredResponse,
    encryption::{EncryptionKeys, Unreadable, open, seal},
    store::{Claim, ClaimRequest},
};

/// The layer's or runner's keys, if it was given any.
#[derive(Clone, Debug, Default)]
pub(crate) struct Sealing(Option<EncryptionKeys>);

impl Sealing {
    pub(crate) fn new(keys: EncryptionKeys) -> Self {
        Self(Some(keys))
    }

    /// The key as the store holds it: its keyed hash once the layer has keys.
    pub(crate) fn stored_key<'k>(&self, key: &'k str) -> Cow<'k, str> {
        match &self.0 {
            Some(keys) => Cow::Owned(keys.stored_key(key)),
            None => Cow::Borrowed(key),
        }
    }

    /// Whether a key new under its hash is looked up in clear too: the layer has keys,
    /// and records written before it had them may be left.
    pub(crate) fn looks_up_clear_keys(&self) -> bool {
        self.0.as_ref().is_some_and(EncryptionKeys::accepts_clear)
    }

    /// `response` as the record of `key` (as stored) in `scope` keeps it: sealed once
    /// the layer has keys. Each call seals anew (a new nonce): seal once per completion.
    pub(crate) fn seal(
        &self,
        scope: &Scope,
        key: &str,
        response: StoredResponse,
    ) -> StoredResponse {
        match &self.0 {
            Some(keys) => seal(keys, scope, key, &response),
            None => response,
        }
    }

    /// What `claim` found, its response opened if it is the one to replay to the
    /// request (same fingerprint); `Err` if it cannot be, logged at `error` with
    /// the hash of `key`, the client's key (never the key itself).
    pub(crate) fn opened(
        &self,
        claim: Claim,
        request: &ClaimRequest<'_>,
        key: &str,
    ) -> Result<Claim, Unreadable> {
        let Claim::Completed {
            fingerprint,
            response,
        } = claim
        else {
            return Ok(claim);
        };
        // Another request's key: refused as such, whatever its record holds.
        if !request.fingerprint.matches(&fingerprint) {
            return Ok(Claim::Completed {
                fingerprint,
                response,
            });
        }
        match open(self.0.as_ref(), request.scope, request.key, response) {
            Ok(response) => Ok(Claim::Completed {
                fingerprint,
                response,
            }),
            Err(unreadable) => {
                tracing::error!(
                    key_hash = crate::request::short_hash(key.as_bytes()).as_str(),
                    key_id = unreadable.key_id(),
                    reason = %unreadable,
                    "the key's stored response could not be opened; it is not replayed, and nothing is run again"
                );
                Err(unreadable)
            }
        }
    }

    /// A step's result as the record of `key` (as stored) in `scope` keeps it: sealed
    /// once the layer has keys, bound to the key and the step's place, so that a result
    /// cannot be moved to another key or place unnoticed.
    pub(crate) fn seal_step(&self, scope: &Scope, key: &str, n: u32, result: Vec<u8>) -> Bytes {
        match &self.0 {
            Some(keys) => {
                seal(
                    keys,
                    scope,
                    &step_bound(key, n),
                    &step_response(result.into()),
                )
                .body
            }
            None => result.into(),
        }
    }

    /// A step's recorded result, opened if the layer has keys (and so sealed it).
    pub(crate) fn open_step(
        &self,
        scope: &Scope,
        key: &str,
        n: u32,
        result: Bytes,
    ) -> Result<Bytes, Unreadable> {
        if self.0.is_none() {
            return Ok(result);
        }
        let mut sealed = step_response(result);
        sealed
            .headers
            .insert(crate::record::SEALED, http::HeaderValue::from_static("1"));
        open(self.0.as_ref(), scope, &step_bound(key, n), sealed).map(|opened| opened.body)
    }
}

impl Sealing {
    /// The request of a resumable key, sealed for the key once the layer has keys.
    pub(crate) fn seal_request(&self, scope: &Scope, key: &str, request: Vec<u8>) -> Bytes {
        match &self.0 {
            Some(keys) => {
                seal(
                    keys,
                    scope,
                    &request_bound(key),
                    &step_response(request.into()),
                )
                .body
            }
            None => request.into(),
        }
    }

    /// The stored request of a resumable key, opened if the layer has keys.
    pub(crate) fn open_request(
        &self,
        scope: &Scope,
        key: &str,
        request: Bytes,
    ) -> Result<Bytes, Unreadable> {
        if self.0.is_none() {
            return Ok(request);
        }
        let mut sealed = step_response(request);
        sealed
            .headers
            .insert(crate::record::SEALED, http::HeaderValue::from_static("1"));
        open(self.0.as_ref(), scope, &request_bound(key), sealed).map(|opened| opened.body)
    }
}

/// What the request of a resumable key is sealed for.
fn request_bound(key: &str) -> String {
    format!("{key}\0request")
}

/// What a step's result is sealed for: the key, and the step's place (a NUL cannot be in
/// a key).
fn step_bound(key: &str, n: u32) -> String {
    format!("{key}\0step {n}")
}

/// A step's result as a response to seal or open.
fn step_response(body: Bytes) -> StoredResponse {
    StoredResponse {
        status: http::StatusCode::OK,
        headers: http::HeaderMap::new(),
        body,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_step_result_is_sealed_for_its_key_and_place() {
        let sealing = Sealing::new(EncryptionKeys::new(1, [7; 32]));
        let scope = Scope::new("acct");
        let result = br#"{"Charge":"ch_1"}"#.to_vec();
        let sealed = sealing.seal_step(&scope, "k", 0, result.clone());
        assert!(!sealed.windows(4).any(|w| w == b"ch_1"), "in clear");
        let opened = sealing.open_step(&scope, "k", 0, sealed.clone());
        assert_eq!(opened.expect("opens"), Bytes::from(result.clone()));
        assert!(sealing.open_step(&scope, "k", 1, sealed.clone()).is_err());
        assert!(sealing.open_step(&scope, "other", 0, sealed).is_err());
        let clear = Sealing::default();
        assert_eq!(
            clear.seal_step(&scope, "k", 0, result.clone()),
            Bytes::from(result)
        );
    }
}
