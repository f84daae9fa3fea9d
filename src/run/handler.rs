//! The inner service called, and its response read whole, up to the storage limit and
//! the body's deadline, so that it can be stored: what the handler produced.

use std::{future::Future, pin::Pin, task::Poll};

use bytes::{Bytes, BytesMut};
use http::{Request, Response};
use http_body::Body;
use tower_service::Service;

use crate::{answers::Unbuffered, body::BoxError, layer::Config};

/// What the inner service produced, read up to the storage limit and the body deadline.
pub(crate) enum Produced<B, E> {
    Buffered(http::response::Parts, Bytes),
    /// The head, the body read so far, and the rest of it.
    Unbuffered(http::response::Parts, Bytes, Pin<Box<B>>, Unbuffered),
    /// The head, and what the body failed with.
    BodyFailed(http::response::Parts, BoxError),
    ServiceFailed(E),
}

pub(crate) async fn run_inner<S, ReqBody, ResBody>(
    mut inner: S,
    req: Request<ReqBody>,
    config: &Config,
) -> Produced<ResBody, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    ResBody: Body<Data = Bytes>,
    ResBody::Error: Into<BoxError>,
{
    // Ready only now that the key is ours (see `call`); in transactional mode, ready
    // already, since before the transaction opened, and this returns at once.
    if let Err(e) = std::future::poll_fn(|cx| inner.poll_ready(cx)).await {
        return Produced::ServiceFailed(e);
    }
    let res = match inner.call(req).await {
        Ok(res) => res,
        Err(e) => return Produced::ServiceFailed(e),
    };
    let (parts, body) = res.into_parts();
    let mut body = Box::pin(body);
    let mut chunks: Vec<Bytes> = Vec::new();
    let mut len = 0;
    let limit = config.response_body_limit;
    let ends_by = tokio::time::Instant::now() + config.response_body_timeout;
    // A timer only for a body that has to wait: most bodies are ready at once.
    let mut deadline: Option<Pin<Box<tokio::time::Sleep>>> = None;
    loop {
        let next = std::future::poll_fn(|cx| {
            if let Poll::Ready(frame) = body.as_mut().poll_frame(cx) {
                return Poll::Ready(Some(frame));
            }
            let timer = deadline.get_or_insert_with(|| Box::pin(tokio::time::sleep_until(ends_by)));
            timer.as_mut().poll(cx).map(|()| None)
        });
        let frame = match next.await {
            Some(Some(Ok(frame))) => frame,
            Some(Some(Err(e))) => return Produced::BodyFailed(parts, e.into()),
            Some(None) => break,
            None => {
                let read = concat(chunks, len);
                return Produced::Unbuffered(parts, read, body, Unbuffered::TooSlow);
            }
        };
        // Trailers are not stored.
        let Ok(data) = frame.into_data() else {
            continue;
        };
        len += data.len();
        chunks.push(data);
        if len > limit {
            return Produced::Unbuffered(parts, concat(chunks, len), body, Unbuffered::TooLarge);
        }
    }
    // Trailers are not passed on with a buffered response either: it must not announce
    // them (RFC 9110 section 6.6.2).
    let mut parts = parts;
    parts.headers.remove(http::header::TRAILER);
    Produced::Buffered(parts, concat(chunks, len))
}

fn concat(mut chunks: Vec<Bytes>, len: usize) -> Bytes {
    if chunks.len() == 1 {
        return chunks.pop().unwrap_or_default();
    }
    let mut buf = BytesMut::with_capacity(len);
    for c in chunks {
        buf.extend_from_slice(&c);
    }
    buf.freeze()
}
