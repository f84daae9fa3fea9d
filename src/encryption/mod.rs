//! Stored responses sealed, and keys hashed, so that whoever reads the table (a dump, a
//! backup, a replica, a role with `SELECT`) reads no response and no live key.
//!
//! Give the layer [`EncryptionKeys`] with
//! [`encrypt_responses`](crate::IdempotencyLayer::encrypt_responses) (a
//! [`JobRunner`](crate::job::JobRunner) with
//! [`encrypt_results`](crate::job::JobRunner::encrypt_results)), and from then on:
//!
//! - **Every stored response is sealed** with XChaCha20-Poly1305 (an authenticated
//!   cipher): its status stays in clear, its headers and body are sealed together in its
//!   `body`, under the newest key, with a random 192-bit nonce. What is sealed is bound
//!   to the record's scope, key, status and key id: a sealed response copied onto
//!   another key, or with its status changed, does not open, and its replay is
//!   `500 response-unreadable` (logged at `error`), never a replay of what it holds.
//! - **Keys are rotated** by adding one ([`with_key`](EncryptionKeys::with_key)): the
//!   newest key seals, every key given opens what it sealed (each record names its key's
//!   id), and nothing in the table is rewritten. Drop a key once the records it sealed
//!   have expired (the layer's `ttl` after the next key was added).
//! - **Idempotency keys are stored hashed**: HMAC-SHA-256 under a secret derived from the
//!   first key, so a dump does not hold the keys clients still retry with.
//!   [`stored_key`](EncryptionKeys::stored_key) is what the table holds for a key.
//! - **Records written before** (in clear, under clear keys) still replay, until the app
//!   says none is left ([`accept_clear_records`](EncryptionKeys::accept_clear_records)).
//!
//! docs/security.md says what this protects against, and what not.
//!
//! ```
//! use tower_idempotency::{IdempotencyLayer, encryption::EncryptionKeys, store::MemoryStore};
//!
//! // In production, 32 random bytes from the app's secret store, never from the code.
//! let keys = EncryptionKeys::new(1, [7; 32]);
//! let layer = IdempotencyLayer::new(MemoryStore::new()).encrypt_responses(keys);
//! ```

mod envelope;

use std::{fmt, sync::Arc};

use chacha20poly1305::{KeyInit, XChaCha20Poly1305};
use hmac::{Hmac, Mac};
use sha2::Sha256;
use zeroize::Zeroizing;

pub(crate) use envelope::{Unreadable, open, seal};

/// The keys that seal stored responses, each with the id records name it by; the
/// newest (the last given) seals, and all of them open.
///
/// A key is 32 bytes from a cryptographic random source (`openssl rand -hex 32`), kept
/// where the app keeps its other secrets. Its bytes are zeroed when the keys are
/// dropped. The id is the app's own number for the key (its version in a secret store,
/// say): it is stored in clear with every record the key seals, and must never name
/// another key while such records live.
///
/// The first key given ([`new`](Self::new)) also derives the secret that hashes
/// idempotency keys in the table. That secret must not change while records live, or
/// every stored key is looked for under another hash, not found, and its retries run
/// again: rotate by adding keys after the first, and keep building the set with that
/// first key for as long as the layer serves the table.
///
/// ```
/// use tower_idempotency::encryption::EncryptionKeys;
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let keys = EncryptionKeys::new(1, [1; 32]) // the first: hashes keys, opens its records
///     .with_key(2, [2; 32])?; // the newest: seals from now on
/// assert_eq!(keys.sealing_key_id(), 2);
/// assert!(keys.with_key(2, [3; 32]).is_err()); // an id names one key
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct EncryptionKeys {
    inner: Arc<Inner>,
    accept_clear: bool,
}

struct Inner {
    /// By id, in the order given: the last one seals.
    ciphers: Vec<(u32, XChaCha20Poly1305)>,
    /// Keyed with the secret derived from the first key.
    key_hash: Hmac<Sha256>,
}

/// What a key is derived into, each with a label of its own: the cipher key, and the
/// secret that hashes idempotency keys.
const SEALING_LABEL: &[u8] = b"tower-idempotency/v1/sealing";
const KEY_HASH_LABEL: &[u8] = b"tower-idempotency/v1/key-hash";

/// HMAC-SHA-256 of `label` under `key`: 32 bytes, zeroed when dropped.
fn derive(key: &[u8; 32], label: &[u8]) -> Zeroizing<[u8; 32]> {
    let mut mac = <Hmac<Sha256> as KeyInit>::new_from_slice(key).expect("HMAC takes any key");
    mac.update(label);
    Zeroizing::new(mac.finalize().into_bytes().into())
}

fn cipher(key: &[u8; 32]) -> XChaCha20Poly1305 {
    let derived = derive(key, SEALING_LABEL);
    XChaCha20Poly1305::new_from_slice(&derived[..]).expect("a 32-byte key")
}

impl EncryptionKeys {
    /// The first key, under `id`: it seals until a newer one is added, and derives the
    /// secret that hashes idempotency keys for as long as the layer serves the table.
    /// The array passed in is the caller's to zero (`zeroize::Zeroizing` does it).
    pub fn new(id: u32, key: [u8; 32]) -> Self {
        let hash_secret = derive(&key, KEY_HASH_LABEL);
        let key_hash = <Hmac<Sha256> as KeyInit>::new_from_slice(&hash_secret[..])
            .expect("HMAC takes any key");
        Self {
            inner: Arc::new(Inner {
                ciphers: vec![(id, cipher(&key))],
                key_hash,
            }),
            accept_clear: true,
        }
    }

    /// Adds a newer key, under `id`: it seals from now on, and the keys given before
    /// still open what they sealed.
    ///
    /// # Errors
    ///
    /// `id` already names a key of the set.
    pub fn with_key(&self, id: u32, key: [u8; 32]) -> Result<Self, KeyIdTaken> {
        if self.inner.ciphers.iter().any(|(taken, _)| *taken == id) {
            return Err(KeyIdTaken(id));
        }
        let mut ciphers = self.inner.ciphers.clone();
        ciphers.push((id, cipher(&key)));
        Ok(Self {
            inner: Arc::new(Inner {
                ciphers,
                key_hash: self.inner.key_hash.clone(),
            }),
            accept_clear: self.accept_clear,
        })
    }

    /// Whether records stored in clear, under clear keys, are still answered (default
    /// `true`): those written before encryption was turned on.
    ///
    /// While `true`, a claim that takes a key new under its hash looks the key up in
    /// clear too (one more primary-key read, for new keys only; in the
    /// [previous scope](crate::IdempotencyLayer::previous_scope_with) as well, if the
    /// layer has one), and a record found there
    /// is answered as the claim would answer it (replayed, `409`, `422`), the handler
    /// not run; and a clear response is replayed as it is. Once every such record has
    /// expired (one `ttl` after encryption was turned on on every replica), set it to
    /// `false`: new keys cost no look-up, and a clear response found in the table (one
    /// written into it by hand) is refused with `500 response-unreadable` rather than
    /// replayed.
    #[must_use]
    pub fn accept_clear_records(mut self, accepted: bool) -> Self {
        self.accept_clear = accepted;
        self
    }

    /// The id of the key that seals: the newest.
    pub fn sealing_key_id(&self) -> u32 {
        self.sealer().0
    }

    /// What the table holds for the idempotency key `key`: `h:` and the hex HMAC-SHA-256
    /// of the key under the secret derived from the first key. For an operator looking
    /// a client's key up in the table (`WHERE key = …`).
    ///
    /// ```
    /// use tower_idempotency::encryption::EncryptionKeys;
    ///
    /// let keys = EncryptionKeys::new(1, [1; 32]);
    /// let stored = keys.stored_key("order-42");
    /// assert!(stored.starts_with("h:") && stored.len() == 66);
    /// // The same after a rotation: the first key derives it.
    /// assert_eq!(keys.with_key(2, [2; 32]).unwrap().stored_key("order-42"), stored);
    /// ```
    pub fn stored_key(&self, key: &str) -> String {
        let mut mac = self.inner.key_hash.clone();
        mac.update(key.as_bytes());
        let digest = mac.finalize().into_bytes();
        let mut stored = String::with_capacity(66);
        stored.push_str("h:");
        stored.push_str(&crate::hex::encode(&digest));
        stored
    }

    /// The key that seals, with its id.
    pub(crate) fn sealer(&self) -> (u32, &XChaCha20Poly1305) {
        let (id, cipher) = self.inner.ciphers.last().expect("a key set is never empty");
        (*id, cipher)
    }

    /// The key of `id`, if the set has it.
    pub(crate) fn opener(&self, id: u32) -> Option<&XChaCha20Poly1305> {
        self.inner
            .ciphers
            .iter()
            .find(|(given, _)| *given == id)
            .map(|(_, cipher)| cipher)
    }

    /// Whether clear records are still answered.
    pub(crate) fn accepts_clear(&self) -> bool {
        self.accept_clear
    }
}

impl fmt::Debug for EncryptionKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Ids only: never a key's bytes.
        let ids: Vec<u32> = self.inner.ciphers.iter().map(|(id, _)| *id).collect();
        f.debug_struct("EncryptionKeys")
            .field("ids", &ids)
            .field("accept_clear_records", &self.accept_clear)
            .finish()
    }
}

/// [`EncryptionKeys::with_key`] was given an id that already names a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyIdTaken(pub u32);

impl fmt::Display for KeyIdTaken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "encryption key id {} already names a key", self.0)
    }
}

impl std::error::Error for KeyIdTaken {}
