//! A sealed response as the store keeps it: its status in clear; in its body, the
//! envelope (a version, the sealing key's id, a random nonce) and its headers and body
//! sealed together, bound to the record's scope, key, status and key id.
//!
//! ```text
//! body = version (1) | key id (4, big-endian) | nonce (24) | ciphertext | tag (16)
//! sealed = headers' length (4) | headers (their stored encoding) | body
//! associated data = label | version | key id | status (2) | scope's length (4) | scope | key
//! ```

use bytes::Bytes;
use chacha20poly1305::{
    XChaCha20Poly1305, XNonce,
    aead::{AeadInOut, array::Array},
};
use http::{HeaderMap, HeaderValue, StatusCode};

use super::EncryptionKeys;
use crate::{Scope, StoredResponse, record::SEALED};

/// The envelope's version: the first byte of a sealed body.
const VERSION: u8 = 1;
/// The version and the key id.
const HEAD: usize = 1 + 4;
const NONCE: usize = 24;
const TAG: usize = 16;
/// What the associated data begins with: a sealed response opens as nothing else.
const LABEL: &[u8] = b"tower-idempotency/v1/response";

/// Why a stored response could not be opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Unreadable {
    /// It is sealed, and the layer has no keys.
    NoKeys,
    /// It is sealed under a key id the layer's keys do not have.
    UnknownKey(u32),
    /// It did not authenticate under its key: changed, or moved from another record
    /// (another key, scope or status).
    Inauthentic(u32),
    /// Its envelope is not one this version reads.
    Malformed,
    /// It is in clear, and the layer no longer accepts clear records.
    ClearRefused,
}

impl Unreadable {
    /// The id of the key it names, if it names one.
    pub(crate) fn key_id(self) -> Option<u32> {
        match self {
            Self::UnknownKey(id) | Self::Inauthentic(id) => Some(id),
            _ => None,
        }
    }
}

impl std::fmt::Display for Unreadable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::NoKeys => "the response is sealed, and the layer was given no encryption keys",
            Self::UnknownKey(_) => "the response is sealed under a key id the layer's keys do not have",
            Self::Inauthentic(_) => {
                "the sealed response does not authenticate: it was changed, or copied from another key, scope or status"
            }
            Self::Malformed => "the sealed response's envelope is malformed",
            Self::ClearRefused => {
                "the response is stored in clear, and clear records are no longer accepted (accept_clear_records(false))"
            }
        })
    }
}

/// The associated data of a response sealed with envelope `head`, for the record of
/// `key` in `scope` with `status`.
fn associated(head: &[u8], status: StatusCode, scope: &Scope, key: &str) -> Vec<u8> {
    let scope = scope.as_str().as_bytes();
    let mut aad = Vec::with_capacity(LABEL.len() + HEAD + 2 + 4 + scope.len() + key.len());
    aad.extend_from_slice(LABEL);
    aad.extend_from_slice(head);
    aad.extend_from_slice(&status.as_u16().to_be_bytes());
    aad.extend_from_slice(&(scope.len() as u32).to_be_bytes());
    aad.extend_from_slice(scope);
    aad.extend_from_slice(key.as_bytes());
    aad
}

/// `response` sealed under the newest of `keys`, for the record of `key` (as stored) in
/// `scope`: each call draws a new nonce, so a response is sealed once and its sealed
/// form kept for every attempt to store it.
pub(crate) fn seal(
    keys: &EncryptionKeys,
    scope: &Scope,
    key: &str,
    response: &StoredResponse,
) -> StoredResponse {
    let (id, cipher) = keys.sealer();
    let headers = StoredResponse::encode_headers(&response.headers);
    let sealed_len = 4 + headers.len() + response.body.len();
    let mut out = Vec::with_capacity(HEAD + NONCE + sealed_len + TAG);
    out.push(VERSION);
    out.extend_from_slice(&id.to_be_bytes());
    let nonce: [u8; NONCE] = rand::random();
    out.extend_from_slice(&nonce);
    let start = out.len();
    out.extend_from_slice(&(headers.len() as u32).to_be_bytes());
    out.extend_from_slice(&headers);
    out.extend_from_slice(&response.body);
    let aad = associated(&out[..HEAD], response.status, scope, key);
    let tag = cipher
        .encrypt_inout_detached(&XNonce::from(nonce), &aad, (&mut out[start..]).into())
        // Only a message over 256 GiB is refused; a stored body is at most 512 MiB.
        .expect("a response within the stored body limit seals");
    out.extend_from_slice(&tag);
    let mut sealed = HeaderMap::with_capacity(1);
    sealed.insert(SEALED, HeaderValue::from_static("1"));
    StoredResponse {
        status: response.status,
        headers: sealed,
        body: Bytes::from(out),
    }
}

/// The response of the record of `key` (as stored) in `scope`, opened if it is sealed;
/// a clear one as it is, unless `keys` no longer accept clear records.
pub(crate) fn open(
    keys: Option<&EncryptionKeys>,
    scope: &Scope,
    key: &str,
    response: StoredResponse,
) -> Result<StoredResponse, Unreadable> {
    if !StoredResponse::is_sealed_headers(&response.headers) {
        return match keys {
            Some(keys) if !keys.accepts_clear() => Err(Unreadable::ClearRefused),
            _ => Ok(response),
        };
    }
    let keys = keys.ok_or(Unreadable::NoKeys)?;
    let body = &response.body[..];
    if body.len() < HEAD + NONCE + 4 + TAG || body[0] != VERSION {
        return Err(Unreadable::Malformed);
    }
    let id = u32::from_be_bytes([body[1], body[2], body[3], body[4]]);
    let cipher: &XChaCha20Poly1305 = keys.opener(id).ok_or(Unreadable::UnknownKey(id))?;
    let nonce = XNonce::try_from(&body[HEAD..HEAD + NONCE]).map_err(|_| Unreadable::Malformed)?;
    let (sealed, tag) = body[HEAD + NONCE..].split_at(body.len() - HEAD - NONCE - TAG);
    let tag = Array::try_from(tag).map_err(|_| Unreadable::Malformed)?;
    let aad = associated(&body[..HEAD], response.status, scope, key);
    let mut plain = sealed.to_vec();
    cipher
        .decrypt_inout_detached(&nonce, &aad, plain.as_mut_slice().into(), &tag)
        .map_err(|_| Unreadable::Inauthentic(id))?;
    let headers_len = u32::from_be_bytes([plain[0], plain[1], plain[2], plain[3]]) as usize;
    if plain.len() < 4 + headers_len {
        return Err(Unreadable::Malformed);
    }
    let headers = StoredResponse::decode_headers(&plain[4..4 + headers_len])
        .filter(|headers| !StoredResponse::is_sealed_headers(headers))
        .ok_or(Unreadable::Malformed)?;
    let body = Bytes::from(plain).slice(4 + headers_len..);
    Ok(StoredResponse {
        status: response.status,
        headers,
        body,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn response() -> StoredResponse {
        let mut headers = HeaderMap::new();
        headers.insert("location", HeaderValue::from_static("/payments/7"));
        headers.append("x-a", HeaderValue::from_static("1"));
        headers.append("x-a", HeaderValue::from_static("2"));
        StoredResponse {
            status: StatusCode::CREATED,
            headers,
            body: Bytes::from_static(b"{\"card\":\"4242\"}"),
        }
    }

    #[test]
    fn a_sealed_response_opens_as_it_was_and_holds_nothing_of_it_in_clear() {
        let keys = EncryptionKeys::new(3, [9; 32]);
        let scope = Scope::new("acct");
        let sealed = seal(&keys, &scope, "k", &response());
        assert_eq!(sealed.status, StatusCode::CREATED);
        assert!(StoredResponse::is_sealed_headers(&sealed.headers));
        let bytes = &sealed.body[..];
        for secret in [&b"4242"[..], b"/payments/7", b"location"] {
            assert!(!bytes.windows(secret.len()).any(|w| w == secret));
        }
        assert_eq!(&bytes[1..5], &3u32.to_be_bytes());
        let opened = open(Some(&keys), &scope, "k", sealed).unwrap();
        assert_eq!(opened, response());
    }

    #[test]
    fn a_sealed_response_moved_or_changed_does_not_open() {
        let keys = EncryptionKeys::new(1, [9; 32]);
        let scope = Scope::new("acct");
        let sealed = seal(&keys, &scope, "k", &response());
        let other = Scope::new("other");
        assert_eq!(
            open(Some(&keys), &scope, "k2", sealed.clone()),
            Err(Unreadable::Inauthentic(1))
        );
        assert_eq!(
            open(Some(&keys), &other, "k", sealed.clone()),
            Err(Unreadable::Inauthentic(1))
        );
        let mut status = sealed.clone();
        status.status = StatusCode::OK;
        assert_eq!(
            open(Some(&keys), &scope, "k", status),
            Err(Unreadable::Inauthentic(1))
        );
        let mut flipped = sealed.body.to_vec();
        let last = flipped.len() - 20;
        flipped[last] ^= 1;
        let flipped = StoredResponse {
            body: flipped.into(),
            ..sealed.clone()
        };
        assert_eq!(
            open(Some(&keys), &scope, "k", flipped),
            Err(Unreadable::Inauthentic(1))
        );
        let other_key = EncryptionKeys::new(1, [8; 32]);
        assert_eq!(
            open(Some(&other_key), &scope, "k", sealed.clone()),
            Err(Unreadable::Inauthentic(1))
        );
        assert_eq!(
            open(
                Some(&EncryptionKeys::new(2, [9; 32])),
                &scope,
                "k",
                sealed.clone()
            ),
            Err(Unreadable::UnknownKey(1))
        );
        assert_eq!(
            open(None, &scope, "k", sealed.clone()),
            Err(Unreadable::NoKeys)
        );
        let short = StoredResponse {
            body: sealed.body.slice(..20),
            ..sealed
        };
        assert_eq!(
            open(Some(&keys), &scope, "k", short),
            Err(Unreadable::Malformed)
        );
    }

    #[test]
    fn rotated_keys_open_what_older_ones_sealed_and_seal_with_the_newest() {
        let old = EncryptionKeys::new(1, [1; 32]);
        let scope = Scope::new("acct");
        let sealed_before = seal(&old, &scope, "k", &response());
        let rotated = old.with_key(2, [2; 32]).unwrap();
        assert_eq!(
            open(Some(&rotated), &scope, "k", sealed_before).unwrap(),
            response()
        );
        let sealed_after = seal(&rotated, &scope, "k", &response());
        assert_eq!(&sealed_after.body[1..5], &2u32.to_be_bytes());
        assert_eq!(
            open(Some(&old), &scope, "k", sealed_after),
            Err(Unreadable::UnknownKey(2))
        );
    }

    #[test]
    fn clear_responses_pass_until_refused() {
        let keys = EncryptionKeys::new(1, [1; 32]);
        let scope = Scope::new("acct");
        assert_eq!(
            open(Some(&keys), &scope, "k", response()).unwrap(),
            response()
        );
        assert_eq!(open(None, &scope, "k", response()).unwrap(), response());
        let refusing = keys.accept_clear_records(false);
        assert_eq!(
            open(Some(&refusing), &scope, "k", response()),
            Err(Unreadable::ClearRefused)
        );
    }

    #[test]
    fn a_sealed_response_is_stored_as_one_and_read_back_as_one() {
        let keys = EncryptionKeys::new(1, [1; 32]);
        let sealed = seal(&keys, &Scope::new("s"), "k", &response());
        let encoded = StoredResponse::encode_headers(&sealed.headers);
        assert_eq!(&encoded[..], &[0xff; 4]);
        let decoded = StoredResponse::decode_headers(&encoded).unwrap();
        assert!(StoredResponse::is_sealed_headers(&decoded));
        // A clear response with a header of the reserved name, stored before it was
        // reserved, reads back in clear, without it.
        let mut h = HeaderMap::new();
        h.insert(SEALED, HeaderValue::from_static("1"));
        let mut legacy = bytes::BytesMut::new();
        use bytes::BufMut;
        legacy.put_u32(1);
        legacy.put_u32(SEALED.as_str().len() as u32);
        legacy.put_slice(SEALED.as_str().as_bytes());
        legacy.put_u32(1);
        legacy.put_slice(b"1");
        let decoded = StoredResponse::decode_headers(&legacy).unwrap();
        assert!(decoded.is_empty());
        assert!(!StoredResponse::is_sealed_headers(&decoded));
        let _ = h;
    }
}
