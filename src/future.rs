//! [`ResponseFuture`]: a request passed through, answered at once, or guarded; and
//! what keeps a guarded request going once its client has gone.

use std::{
    future::Future,
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    task::{Context, Poll},
};

use http::Response;
use pin_project_lite::pin_project;

use crate::{Outcome, body::ResponseBody, store::BoxFuture};

/// What a guarded request's future gives: a response, or the inner service's error.
pub(crate) type Answer<B, E> = Result<Response<ResponseBody<B>>, E>;

pin_project! {
    /// The response future of [`Idempotency`](crate::Idempotency).
    ///
    /// Dropping it before it is done (the client hung up, or a timeout outside this layer
    /// gave up) does not cancel a request whose claim may be in flight or held: the rest
    /// of it moves to a task of its own, which finishes the claim, runs the handler to
    /// the end and stores or releases its result. Dropped while it holds no claim
    /// (before its first poll, while the body is being read, while a duplicate waits
    /// for the running request), the request is simply dropped; so is a duplicate
    /// whose client went while its claim was on the way, once the claim finds the key
    /// still running: it does not wait to run the handler for nobody. Outside a Tokio
    /// runtime the work cannot move, and the key then frees when its lease lapses, as
    /// after a crash.
    pub struct ResponseFuture<F, B, E> {
        #[pin]
        kind: Kind<F, B, E>,
    }

    impl<F, B, E> PinnedDrop for ResponseFuture<F, B, E> {
        fn drop(this: Pin<&mut Self>) {
            if let KindProj::Guarded { future, detach, handoff } = this.project().kind.project()
                && let Some(future) = future.take()
                    && handoff.detach() {
                        detach(future);
                    }
        }
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<F, B, E> {
        PassThrough { #[pin] future: F },
        Answered { res: Option<Response<ResponseBody<B>>> },
        Guarded {
            // `None` once it has returned its answer.
            future: Option<BoxFuture<'static, Answer<B, E>>>,
            // Spawns an unfinished `future`; built where its bounds are known.
            detach: fn(BoxFuture<'static, Answer<B, E>>),
            // Whether the future must finish even if dropped, and whether it was.
            handoff: Arc<Handoff>,
        },
    }
}

impl<F, B, E> Future for ResponseFuture<F, B, E>
where
    F: Future<Output = Result<Response<B>, E>>,
{
    type Output = Answer<B, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().kind.project() {
            KindProj::PassThrough { future } => future.poll(cx).map_ok(|res| {
                let mut res = res.map(ResponseBody::inner);
                res.extensions_mut().insert(Outcome::PassedThrough);
                res
            }),
            KindProj::Answered { res } => match res.take() {
                Some(res) => Poll::Ready(Ok(res)),
                None => panic!("ResponseFuture polled after completion"),
            },
            KindProj::Guarded { future, .. } => {
                let Some(running) = future.as_mut() else {
                    panic!("ResponseFuture polled after completion");
                };
                let answer = std::task::ready!(running.as_mut().poll(cx));
                *future = None;
                Poll::Ready(answer)
            }
        }
    }
}

/// Shared by a guarded request's future and its [`ResponseFuture`]: whether the request
/// must finish if its client goes (a claim may be on its way to the store, or held),
/// and whether its client has gone.
#[derive(Debug, Default)]
pub(crate) struct Handoff {
    claiming: AtomicBool,
    detached: AtomicBool,
}

impl Handoff {
    /// From now on the request finishes even if its response future is dropped.
    pub(crate) fn hold(&self) {
        self.claiming.store(true, Ordering::Release);
    }

    /// From now on the request holds nothing: dropping its response future drops it.
    /// False if it was already moved to a task of its own because its client had gone:
    /// it then has nobody to answer, and stops.
    pub(crate) fn let_go(&self) -> bool {
        self.claiming.store(false, Ordering::Release);
        !self.detached.load(Ordering::Acquire)
    }

    /// Called as the response future is dropped: whether the rest must run in a task.
    fn detach(&self) -> bool {
        let holding = self.claiming.load(Ordering::Acquire);
        self.detached.store(holding, Ordering::Release);
        holding
    }
}

/// Hands a guarded request's unfinished work to a task of its own.
pub(crate) fn detach<B: Send + 'static, E: Send + 'static>(
    future: BoxFuture<'static, Answer<B, E>>,
) {
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => drop(runtime.spawn(future)),
        Err(_) => tracing::warn!(
            "a guarded request was dropped outside a Tokio runtime before it finished; its key frees when its lease lapses"
        ),
    }
}

impl<F, B, E> ResponseFuture<F, B, E> {
    /// A guarded request's `future`, with the `detach` that moves it to a task of its
    /// own if it is dropped while `handoff` holds it.
    pub(crate) fn guarded(
        future: BoxFuture<'static, Answer<B, E>>,
        detach: fn(BoxFuture<'static, Answer<B, E>>),
        handoff: Arc<Handoff>,
    ) -> Self {
        Self {
            kind: Kind::Guarded {
                future: Some(future),
                detach,
                handoff,
            },
        }
    }
}

pub(crate) fn pass_through<F, B, E>(future: F) -> ResponseFuture<F, B, E> {
    ResponseFuture {
        kind: Kind::PassThrough { future },
    }
}

pub(crate) fn answered<F, B, E>(res: Response<ResponseBody<B>>) -> ResponseFuture<F, B, E> {
    ResponseFuture {
        kind: Kind::Answered { res: Some(res) },
    }
}
