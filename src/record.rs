//! The stored response: what a duplicate gets back, byte for byte.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};

/// A response as stored for replay: status, end-to-end headers, body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    /// The status code.
    pub status: StatusCode,
    /// The stored headers (hop-by-hop and excluded headers already removed).
    pub headers: HeaderMap,
    /// The complete body.
    pub body: Bytes,
}

/// Headers never stored: the connection-specific ones of RFC 9110 §7.6.1
/// (`Connection` and the fields it names, `Proxy-Connection`, `Keep-Alive`, `TE`,
/// `Transfer-Encoding`, `Upgrade`); `Trailer`, since trailers are not stored, so a
/// replay must not announce them; and `Content-Length`, recomputed from the stored body.
const NOT_STORED: [HeaderName; 8] = [
    header::CONNECTION,
    HeaderName::from_static("proxy-connection"),
    HeaderName::from_static("keep-alive"),
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    SEALED,
];

/// The one header of a sealed response as the store keeps it
/// ([`encrypt_responses`](crate::IdempotencyLayer::encrypt_responses)): its status in
/// clear, its headers and body sealed in its body. Reserved: a response's own header of
/// this name is never stored, so a record with it is sealed, and nothing else is.
pub(crate) const SEALED: HeaderName = HeaderName::from_static("tower-idempotency-sealed");

/// The encoding of a sealed response's headers: a count no headers can have (their
/// encoding would be over 32 GiB, and PostgreSQL's values stop at 1 GiB), so that a
/// sealed record is told from a clear one by its first bytes, whatever wrote it.
const SEALED_ENCODING: [u8; 4] = [0xff; 4];

impl StoredResponse {
    /// Whether `headers` are those of a sealed response: the reserved header alone.
    pub(crate) fn is_sealed_headers(headers: &HeaderMap) -> bool {
        headers.len() == 1 && headers.contains_key(SEALED)
    }

    /// Keeps the end-to-end headers of `headers`, then lets `remove` take out what it
    /// will not have stored (the app's [`unreplayed_headers_with`]); the reserved name of
    /// a sealed record never stays.
    ///
    /// [`unreplayed_headers_with`]: crate::IdempotencyLayer::unreplayed_headers_with
    pub(crate) fn storable_headers(
        headers: &HeaderMap,
        remove: &(dyn Fn(&mut HeaderMap) + Send + Sync),
    ) -> HeaderMap {
        let mut out = Self::end_to_end(headers);
        remove(&mut out);
        out.remove(SEALED);
        out
    }

    /// The end-to-end headers of `headers`.
    fn end_to_end(headers: &HeaderMap) -> HeaderMap {
        let connection_named: Vec<HeaderName> = headers
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
            .collect();
        let mut out = HeaderMap::with_capacity(headers.len());
        for (name, value) in headers {
            if NOT_STORED.contains(name)
                || name == header::CONTENT_LENGTH
                || connection_named.contains(name)
            {
                continue;
            }
            out.append(name.clone(), value.clone());
        }
        out
    }

    /// Encodes the headers for storage: a count, then length-prefixed names and values.
    /// A sealed response's ([`encrypt_responses`](crate::IdempotencyLayer::encrypt_responses))
    /// are four bytes `0xff`, which no clear headers encode to.
    pub fn encode_headers(headers: &HeaderMap) -> Bytes {
        if Self::is_sealed_headers(headers) {
            return Bytes::from_static(&SEALED_ENCODING);
        }
        let mut buf = BytesMut::with_capacity(4 + headers.len() * 48);
        buf.put_u32(headers.len() as u32 - headers.get_all(SEALED).iter().count() as u32);
        for (name, value) in headers.iter().filter(|(name, _)| **name != SEALED) {
            buf.put_u32(name.as_str().len() as u32);
            buf.put_slice(name.as_str().as_bytes());
            buf.put_u32(value.len() as u32);
            buf.put_slice(value.as_bytes());
        }
        buf.freeze()
    }

    /// Decodes what [`encode_headers`](Self::encode_headers) wrote; `None` if corrupt.
    pub fn decode_headers(mut bytes: &[u8]) -> Option<HeaderMap> {
        if bytes == SEALED_ENCODING {
            let mut sealed = HeaderMap::with_capacity(1);
            sealed.insert(SEALED, HeaderValue::from_static("1"));
            return Some(sealed);
        }
        fn chunk<'a>(bytes: &mut &'a [u8]) -> Option<&'a [u8]> {
            if bytes.remaining() < 4 {
                return None;
            }
            let len = bytes.get_u32() as usize;
            if bytes.len() < len {
                return None;
            }
            let (head, tail) = bytes.split_at(len);
            *bytes = tail;
            Some(head)
        }
        if bytes.remaining() < 4 {
            return None;
        }
        let count = bytes.get_u32() as usize;
        // One more than stored: a replay adds `Idempotent-Replayed`, and a map sized for
        // exactly `count` would grow (allocate and rehash) to take it.
        let mut headers = HeaderMap::with_capacity(count.min(64) + 1);
        for _ in 0..count {
            let name = HeaderName::from_bytes(chunk(&mut bytes)?).ok()?;
            let value = HeaderValue::from_bytes(chunk(&mut bytes)?).ok()?;
            // The reserved name, in clear headers stored before it was: not a seal.
            if name != SEALED {
                headers.append(name, value);
            }
        }
        bytes.is_empty().then_some(headers)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_in_order_with_repeats() {
        let mut h = HeaderMap::new();
        h.append("content-type", HeaderValue::from_static("application/json"));
        h.append("x-a", HeaderValue::from_static("1"));
        h.append("x-a", HeaderValue::from_static("2"));
        h.append("x-bin", HeaderValue::from_bytes(b"\xff\x80").unwrap());
        let decoded = StoredResponse::decode_headers(&StoredResponse::encode_headers(&h)).unwrap();
        assert_eq!(decoded, h);
        let xa: Vec<_> = decoded.get_all("x-a").iter().collect();
        assert_eq!(xa, ["1", "2"]);
    }

    #[test]
    fn a_decoded_map_takes_the_replay_header_without_growing() {
        for n in 0..12 {
            let mut h = HeaderMap::new();
            for i in 0..n {
                h.append(
                    HeaderName::from_bytes(format!("x-{i}").as_bytes()).unwrap(),
                    HeaderValue::from_static("v"),
                );
            }
            let mut decoded =
                StoredResponse::decode_headers(&StoredResponse::encode_headers(&h)).unwrap();
            let capacity = decoded.capacity();
            decoded.insert("idempotent-replayed", HeaderValue::from_static("true"));
            assert_eq!(decoded.capacity(), capacity, "{n} stored headers");
        }
    }

    #[test]
    fn corrupt_encodings_are_refused() {
        let mut h = HeaderMap::new();
        h.append("x-a", HeaderValue::from_static("1"));
        let enc = StoredResponse::encode_headers(&h);
        assert!(StoredResponse::decode_headers(&enc[..enc.len() - 1]).is_none());
        let mut longer = enc.to_vec();
        longer.push(0);
        assert!(StoredResponse::decode_headers(&longer).is_none());
        assert!(StoredResponse::decode_headers(b"").is_none());
    }

    #[test]
    fn hop_by_hop_and_excluded_headers_are_not_stored() {
        let mut h = HeaderMap::new();
        h.append("connection", HeaderValue::from_static("close, x-conn"));
        h.append("x-conn", HeaderValue::from_static("1"));
        h.append("transfer-encoding", HeaderValue::from_static("chunked"));
        h.append("content-length", HeaderValue::from_static("10"));
        h.append("set-cookie", HeaderValue::from_static("s=1"));
        h.append("location", HeaderValue::from_static("/payments/1"));
        h.append("proxy-connection", HeaderValue::from_static("keep-alive"));
        h.append("keep-alive", HeaderValue::from_static("timeout=5"));
        h.append("upgrade", HeaderValue::from_static("h2c"));
        h.append("trailer", HeaderValue::from_static("x-checksum"));
        h.append("proxy-authenticate", HeaderValue::from_static("Basic"));
        h.append("tower-idempotency-sealed", HeaderValue::from_static("1"));
        let kept = StoredResponse::storable_headers(&h, &|h: &mut HeaderMap| {
            h.remove(header::SET_COOKIE);
        });
        assert_eq!(kept.len(), 2, "{kept:?}");
        assert_eq!(kept["location"], "/payments/1");
        // End-to-end under RFC 9110: a replayed 407 keeps its challenge.
        assert_eq!(kept["proxy-authenticate"], "Basic");
    }
}
