//! The completer: a resumable key left running by a process that died is finished by a
//! live one, even if its client never retries.
//!
//! A layer registered as resumable ([`IdempotencyLayer::resumable`]) records, with each
//! claim, the request its handler needs (method, URI, the headers it names, the body,
//! and the client's key), sealed if the layer has keys. A completer
//! ([`IdempotencyLayer::spawn_completer`]) asks the store, every
//! [`COMPLETER_PERIOD`], for such keys whose holder is known to be gone (liveness:
//! its process dead, not its lease lapsed), and runs each as a request of its own
//! through the lease-mode engine: the claim takes the key over (the store judging the
//! holder gone again, atomically, so that a live holder's key is never taken), the
//! handler runs with the stored request, its recorded steps replayed, and its response
//! is stored for the client's retry to replay.
//!
//! [`IdempotencyLayer::resumable`]: crate::IdempotencyLayer::resumable
//! [`IdempotencyLayer::spawn_completer`]: crate::IdempotencyLayer::spawn_completer

use std::{sync::Arc, time::Duration};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http::{HeaderName, HeaderValue, Method, Request, Response, Uri};
use http_body::Body;
use tower_service::Service;

use crate::{
    body::BoxError,
    layer::Config,
    store::{ClaimRequest, Lease, Orphan},
};

/// How often a completer looks for keys whose holder is gone. With liveness's grace
/// (1 s), a dead holder's key is finished within about a second and a half.
pub(crate) const COMPLETER_PERIOD: Duration = Duration::from_millis(500);

/// How many keys a completer takes at a time.
const ORPHANS_AT_ONCE: usize = 16;

/// What a layer registered as resumable keeps of each request.
#[derive(Clone, Debug)]
pub(crate) struct Resumable {
    /// The name it was registered under: a completer finishes the keys of its name.
    pub(crate) name: Arc<str>,
    /// The headers kept with the request.
    pub(crate) headers: Arc<[HeaderName]>,
}

/// The request of a resumable key, as recorded: the client's key, and what the handler
/// needs to run again.
struct Stored {
    key: String,
    method: Method,
    uri: Uri,
    headers: Vec<(HeaderName, HeaderValue)>,
    body: Bytes,
}

fn put(out: &mut BytesMut, bytes: &[u8]) {
    out.put_u32(bytes.len() as u32);
    out.put_slice(bytes);
}

fn take(input: &mut Bytes) -> Option<Bytes> {
    if input.remaining() < 4 {
        return None;
    }
    let len = input.get_u32() as usize;
    (input.remaining() >= len).then(|| input.split_to(len))
}

impl Stored {
    fn encode(&self) -> Vec<u8> {
        let mut out = BytesMut::new();
        put(&mut out, self.key.as_bytes());
        put(&mut out, self.method.as_str().as_bytes());
        put(&mut out, self.uri.to_string().as_bytes());
        put(&mut out, &self.body);
        out.put_u32(self.headers.len() as u32);
        for (name, value) in &self.headers {
            put(&mut out, name.as_str().as_bytes());
            put(&mut out, value.as_bytes());
        }
        out.to_vec()
    }

    fn decode(mut input: Bytes) -> Option<Self> {
        let text = |b: Bytes| String::from_utf8(b.to_vec()).ok();
        let key = text(take(&mut input)?)?;
        let method = Method::from_bytes(&take(&mut input)?).ok()?;
        let uri = Uri::try_from(text(take(&mut input)?)?).ok()?;
        let body = take(&mut input)?;
        if input.remaining() < 4 {
            return None;
        }
        let count = input.get_u32();
        let mut headers = Vec::new();
        for _ in 0..count {
            let name = HeaderName::from_bytes(&take(&mut input)?).ok()?;
            let value = HeaderValue::from_maybe_shared(take(&mut input)?).ok()?;
            headers.push((name, value));
        }
        Some(Self {
            key,
            method,
            uri,
            headers,
            body,
        })
    }
}

/// Records the request of a resumable key under its lease, if the layer is registered
/// as resumable. A failure is logged: the request runs, and only its completion by
/// another process, should this one die, is lost.
pub(crate) async fn record(
    config: &Config,
    lease: &Lease,
    parts: &http::request::Parts,
    body: &Bytes,
    key: &str,
) {
    let Some(resumable) = &config.resumable else {
        return;
    };
    let headers = resumable
        .headers
        .iter()
        .flat_map(|name| {
            let values = parts.headers.get_all(name).iter();
            values.map(move |value| (name.clone(), value.clone()))
        })
        .collect();
    let stored = Stored {
        key: key.to_owned(),
        method: parts.method.clone(),
        uri: parts.uri.clone(),
        headers,
        body: body.clone(),
    };
    let sealed = config
        .sealing
        .seal_request(&lease.scope, &lease.key, stored.encode());
    let recording = config.store.record_request(lease, &resumable.name, &sealed);
    match crate::store::within(config.store_timeout, "recording a request", recording).await {
        Ok(fenced) if fenced.is_kept() => {}
        Ok(_) => {
            tracing::warn!("the request of a resumable key was not recorded: its lease was lost")
        }
        Err(e) => tracing::warn!(
            error = %e,
            "the request of a resumable key could not be recorded; should this process die, it is finished only by a retry"
        ),
    }
}

/// Runs the completer of `config`'s resumable name over `inner`, until the layer is
/// closed ([`ShutdownHandle::close`](crate::ShutdownHandle::close)) or the task
/// aborted.
pub(crate) async fn run<S, ResBody>(config: Arc<Config>, inner: S)
where
    S: Service<Request<http_body_util::Full<Bytes>>, Response = Response<ResBody>>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let Some(resumable) = config.resumable.clone() else {
        tracing::warn!("a completer of a layer not registered as resumable finds nothing to do");
        return;
    };
    let mut tick = tokio::time::interval(COMPLETER_PERIOD);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            () = config.shutdown.closed() => return,
        }
        let found = config.store.orphans(&resumable.name, ORPHANS_AT_ONCE);
        let orphans = match crate::store::within(config.store_timeout, "orphans", found).await {
            Ok(orphans) => orphans,
            Err(e) => {
                tracing::warn!(error = %e, "the completer could not look for keys left by holders gone");
                continue;
            }
        };
        for orphan in orphans {
            complete(&config, inner.clone(), orphan).await;
        }
    }
}

/// Runs the stored request of `orphan` through the lease-mode engine: its claim takes
/// the key over if its holder is still judged gone, and the response is stored.
async fn complete<S, ResBody>(config: &Arc<Config>, inner: S, orphan: Orphan)
where
    S: Service<Request<http_body_util::Full<Bytes>>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let opened = config
        .sealing
        .open_request(&orphan.scope, &orphan.key, orphan.request);
    let Some(stored) = opened.ok().and_then(Stored::decode) else {
        tracing::error!(
            "the stored request of a key left by a holder gone could not be read; it is left for a retry"
        );
        return;
    };
    let Some(in_flight) = config.shutdown.enter() else {
        return;
    };
    let mut builder = Request::builder().method(stored.method).uri(stored.uri);
    for (name, value) in stored.headers {
        builder = builder.header(name, value);
    }
    let Ok(req) = builder.body(()) else {
        return;
    };
    let (parts, ()) = req.into_parts();
    let request = ClaimRequest {
        scope: &orphan.scope,
        key: &orphan.key,
        fingerprint: orphan.fingerprint,
        lease: config.lease,
        ttl: config.ttl,
    };
    let handoff = crate::future::Handoff::default();
    let serving = crate::run::lease::serve(
        config.clone(),
        inner,
        parts,
        stored.body,
        request,
        &stored.key,
        in_flight,
        &handoff,
    );
    match Box::pin(serving).await {
        Ok(res) => tracing::info!(
            status = res.status().as_u16(),
            outcome = ?res.extensions().get::<crate::Outcome>(),
            "a resumable key left by a holder gone was run to its end"
        ),
        Err(_) => tracing::warn!("a resumable key left by a holder gone failed in its service"),
    }
}
