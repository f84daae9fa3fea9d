//! What a guarded request brings: its key ([`key`]), its scope ([`scope`]; found from
//! its [`principal`] or otherwise, [`scoping`]), its fingerprint ([`fingerprint`]) and
//! its body, read within bounds; and what a layer leaves in its extensions ([`marks`]).

pub(crate) mod fingerprint;
pub(crate) mod key;
mod marks;
pub(crate) mod principal;
pub(crate) mod scope;
pub(crate) mod scoping;

use bytes::{Buf, Bytes, BytesMut};
use http::{Response, header};
use http_body::Body;
use http_body_util::{BodyExt, LengthLimitError, Limited};

#[cfg(feature = "axum")]
pub(crate) use marks::problems_in;
#[cfg(feature = "axum")]
pub(crate) use marks::unkeyed_in;
pub(crate) use marks::{Guarded, hand_over, header_label, mark_problems, mark_unkeyed};

use crate::{
    answers::{reject, too_large},
    body::{BoxError, ResponseBody},
    layer::Config,
    rejection::Problem,
};

/// Reads a guarded request's body, bounded in size (`request_body_limit`, by
/// `Content-Length` and by counting) and in time (`request_body_timeout`): a body that
/// never ends, or trickles in, is cut off before anything is claimed. `Err`: the
/// rejection to answer.
pub(crate) async fn read_body<B, R>(
    config: &Config,
    headers: &http::HeaderMap,
    body: B,
) -> Result<Bytes, Response<ResponseBody<R>>>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    let limit = config.request_body_limit;
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|len| len > limit as u64) {
        return Err(too_large(&config.problems, limit));
    }
    let read = tokio::time::timeout(config.request_body_timeout, collect(body, limit));
    match read.await {
        Ok(Ok(bytes)) => Ok(bytes),
        Ok(Err(e)) if e.downcast_ref::<LengthLimitError>().is_some() => {
            Err(too_large(&config.problems, limit))
        }
        // A limit set in front of the layer (a `Limited` body, wrapped on its way).
        Ok(Err(e)) if over_a_limit(&*e) => Err(reject(
            &config.problems,
            Problem::BodyTooLarge,
            &format!("the request body is over a size limit: {e}"),
        )),
        Ok(Err(e)) => Err(reject(
            &config.problems,
            Problem::BodyUnreadable,
            &format!("the request body could not be read: {e}"),
        )),
        Err(_) => Err(reject(
            &config.problems,
            Problem::BodyTimeout,
            &format!(
                "the request body did not arrive within {} ms; nothing was processed",
                config.request_body_timeout.as_millis()
            ),
        )),
    }
}

/// `body`'s data, within `limit` bytes (`Limited`'s error past it); its trailers are
/// dropped. What `BodyExt::collect` and `Collected::to_bytes` give, without their list
/// of chunks: a body that comes in one frame, as most do, is handed on as it came, with
/// no allocation; one in several is copied into one buffer, as `to_bytes` does.
async fn collect<B>(body: B, limit: usize) -> Result<Bytes, BoxError>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    let mut body = std::pin::pin!(Limited::new(body, limit));
    let mut first: Option<Bytes> = None;
    let mut more: Option<BytesMut> = None;
    while let Some(frame) = body.frame().await {
        let Ok(mut data) = frame?.into_data() else {
            continue;
        };
        if !data.has_remaining() {
            continue;
        }
        let data = data.copy_to_bytes(data.remaining());
        if let Some(buf) = &mut more {
            buf.extend_from_slice(&data);
        } else if let Some(head) = first.take() {
            let mut buf = BytesMut::with_capacity(head.len() + data.len());
            buf.extend_from_slice(&head);
            buf.extend_from_slice(&data);
            more = Some(buf);
        } else {
            first = Some(data);
        }
    }
    Ok(match more {
        Some(buf) => buf.freeze(),
        None => first.unwrap_or_default(),
    })
}

/// Whether `e`, or an error it wraps, is a body over a size limit.
fn over_a_limit(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cause = Some(e);
    while let Some(e) = cause {
        if e.is::<LengthLimitError>() {
            return true;
        }
        cause = e.source();
    }
    false
}

/// The first 16 hex digits of the SHA-256 of `bytes`: enough to correlate, not to recover.
pub(crate) fn short_hash(bytes: &[u8]) -> ShortHash {
    use sha2::Digest;
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let digest = sha2::Sha256::digest(bytes);
    let mut hex = [0u8; 16];
    for (i, b) in digest[..8].iter().enumerate() {
        hex[2 * i] = DIGITS[usize::from(b >> 4)];
        hex[2 * i + 1] = DIGITS[usize::from(b & 0xf)];
    }
    ShortHash(hex)
}

/// [`short_hash`]'s 16 hex digits, on the stack: recorded in every request's span, they
/// cost no allocation.
#[derive(Clone, Copy)]
pub(crate) struct ShortHash([u8; 16]);

impl ShortHash {
    pub(crate) fn as_str(&self) -> &str {
        // Hex digits only: always UTF-8.
        std::str::from_utf8(&self.0).unwrap_or_default()
    }
}

impl std::fmt::Display for ShortHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}
