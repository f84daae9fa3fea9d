//! The response body the layer returns.

use std::{
    pin::Pin,
    task::{Context, Poll},
};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

/// A boxed error, as returned by [`ResponseBody`].
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

pin_project! {
    /// The body of a response from [`Idempotency`](crate::Idempotency): the inner
    /// service's own body when the request passed through, or bytes held by the layer
    /// (an executed response it buffered and stored, a replay, a rejection).
    pub struct ResponseBody<B> {
        #[pin]
        kind: Kind<B>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<B> {
        Full { bytes: Option<Bytes> },
        Inner { #[pin] body: B },
        // A response that could not be stored (over the limit, or too slow): what was
        // buffered, then the rest.
        Prefixed { prefix: Option<Bytes>, rest: Pin<Box<B>> },
    }
}

impl<B> ResponseBody<B> {
    pub(crate) fn full(bytes: Bytes) -> Self {
        Self {
            kind: Kind::Full {
                bytes: (!bytes.is_empty()).then_some(bytes),
            },
        }
    }

    pub(crate) fn inner(body: B) -> Self {
        Self {
            kind: Kind::Inner { body },
        }
    }

    pub(crate) fn prefixed(prefix: Bytes, rest: Pin<Box<B>>) -> Self {
        Self {
            kind: Kind::Prefixed {
                prefix: Some(prefix),
                rest,
            },
        }
    }
}

impl<B> Body for ResponseBody<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.project().kind.project() {
            KindProj::Full { bytes } => Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b)))),
            KindProj::Inner { body } => body.poll_frame(cx).map_err(Into::into),
            KindProj::Prefixed { prefix, rest } => match prefix.take() {
                Some(b) => Poll::Ready(Some(Ok(Frame::data(b)))),
                None => rest.as_mut().poll_frame(cx).map_err(Into::into),
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Full { bytes } => bytes.is_none(),
            Kind::Inner { body } => body.is_end_stream(),
            Kind::Prefixed { prefix, rest } => prefix.is_none() && rest.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Full { bytes } => {
                SizeHint::with_exact(bytes.as_ref().map_or(0, |b| b.len() as u64))
            }
            Kind::Inner { body } => body.size_hint(),
            Kind::Prefixed { prefix, rest } => {
                let extra = prefix.as_ref().map_or(0, |b| b.len() as u64);
                let inner = rest.size_hint();
                let mut hint = SizeHint::new();
                hint.set_lower(inner.lower() + extra);
                if let Some(upper) = inner.upper() {
                    hint.set_upper(upper + extra);
                }
                hint
            }
        }
    }
}

impl<B> std::fmt::Debug for ResponseBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self.kind {
            Kind::Full { .. } => "ResponseBody::Full",
            Kind::Inner { .. } => "ResponseBody::Inner",
            Kind::Prefixed { .. } => "ResponseBody::Prefixed",
        })
    }
}
