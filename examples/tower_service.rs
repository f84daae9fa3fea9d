//! `IdempotencyLayer` on a plain Tower service, served with hyper: no Axum.
//!
//! ```text
//! cargo run --example tower_service -- [--addr 127.0.0.1:3000]
//! ```
//!
//! The service is a function from `Request<Full<Bytes>>` to `Response<Full<Bytes>>`,
//! wrapped with `tower::ServiceBuilder`. The layer needs a request body it can rebuild
//! from bytes (`ReqBody: From<Bytes>`), so each hyper request's body is read into a
//! `Full<Bytes>` before the service is called, bounded as the layer bounds the bodies
//! it reads: in size (a larger one gets the `413 body-too-large` problem document) and
//! in time (a client that sends it too slowly gets `408 body-timeout`, rather than
//! holding the connection's task and its buffer for as long as it likes).
//!
//! The store is in memory, unless `DATABASE_URL` is set: then it is PostgreSQL (the
//! table `public.idempotency_keys`, created on start), shared by every process that
//! points at the same database.

use std::{
    convert::Infallible,
    error::Error,
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
};

use bytes::Bytes;
use http::{HeaderValue, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full, Limited, combinators::BoxBody};
use hyper::{body::Incoming, server::conn::http1, service::service_fn};
use hyper_util::rt::TokioIo;
use tower::{Service, ServiceBuilder, ServiceExt};
use tower_idempotency::{
    BoxError, IdempotencyKey, IdempotencyLayer,
    rejection::Problem,
    store::{MemoryStore, Store},
};

/// The largest request body read from the connection.
const BODY_LIMIT: usize = 1024 * 1024;

/// How long a request body may take to arrive (the layer's own default).
const BODY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// How many jobs [`submit_job`] has created.
static JOBS: AtomicU64 = AtomicU64::new(0);

/// The app: creates a job per request. Behind the layer, a POST with a key runs once
/// per key and its retries get the stored response.
async fn submit_job(req: Request<Full<Bytes>>) -> Result<Response<Full<Bytes>>, Infallible> {
    // The layer puts the key of a guarded request in the extensions.
    let key = req
        .extensions()
        .get::<IdempotencyKey>()
        .map(|k| k.as_str().to_owned());
    let body = req.into_body().collect().await?.to_bytes();
    let id = JOBS.fetch_add(1, Ordering::Relaxed) + 1;
    let job = serde_json::json!({
        "job_id": id,
        "payload": String::from_utf8_lossy(&body),
        "idempotency_key": key,
    });
    let mut res = Response::new(Full::new(Bytes::from(job.to_string())));
    *res.status_mut() = StatusCode::CREATED;
    res.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    Ok(res)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    let addr = parse_addr()?;

    // The Tower service: the layer around a function. Cloning it is cheap.
    let service = ServiceBuilder::new()
        .layer(IdempotencyLayer::new(store().await?).require_key(true))
        .service_fn(submit_job);

    let listener = tokio::net::TcpListener::bind(addr).await?;
    let addr = listener.local_addr()?;
    println!("listening on http://{addr}");
    println!("send this twice; the second answer is replayed (`idempotent-replayed: true`):");
    println!("  curl -i http://{addr}/jobs -H 'Idempotency-Key: job-1' -d 'resize photo.jpg'");
    println!("a POST without a key is refused with 400:");
    println!("  curl -i http://{addr}/jobs -d 'resize photo.jpg'");
    println!("a GET is not guarded: each one runs the service again:");
    println!("  curl -i http://{addr}/jobs");

    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            // Out of file descriptors, say: the server goes on once some are free.
            Err(e) => {
                eprintln!("accept failed: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                continue;
            }
        };
        let service = service.clone();
        tokio::spawn(async move {
            // hyper calls this for each request on the connection.
            let hyper_service = service_fn(move |req| read_and_call(service.clone(), req));
            if let Err(e) = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), hyper_service)
                .await
            {
                eprintln!("connection error: {e}");
            }
        });
    }
}

/// Adapts a hyper request to the Tower service: reads hyper's `Incoming` body into a
/// `Full<Bytes>` (up to [`BODY_LIMIT`]: past it, `413 body-too-large`; within
/// [`BODY_TIMEOUT`]: past it, `408 body-timeout`), then calls `service` with the
/// request.
async fn read_and_call<S, B>(
    service: S,
    req: Request<Incoming>,
) -> Result<Response<BoxBody<Bytes, BoxError>>, BoxError>
where
    S: Service<Request<Full<Bytes>>, Response = Response<B>, Error = Infallible>,
    B: http_body::Body<Data = Bytes> + Send + Sync + 'static,
    B::Error: Into<BoxError>,
{
    let (parts, body) = req.into_parts();
    let problem = |problem: Problem, detail: &str| {
        let res = problem.response(detail);
        Ok(res.map(|b| Full::new(b).map_err(|e| match e {}).boxed()))
    };
    let read = tokio::time::timeout(BODY_TIMEOUT, Limited::new(body, BODY_LIMIT).collect());
    let body = match read.await {
        Ok(Ok(body)) => body.to_bytes(),
        Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => {
            let detail = format!("the request body is over the limit of {BODY_LIMIT} bytes");
            return problem(Problem::BodyTooLarge, &detail);
        }
        Ok(Err(e)) => return Err(e),
        Err(_) => {
            let detail = format!(
                "the request body did not arrive within {} s",
                BODY_TIMEOUT.as_secs()
            );
            return problem(Problem::BodyTimeout, &detail);
        }
    };
    let res = service
        .oneshot(Request::from_parts(parts, Full::new(body)))
        .await?;
    Ok(res.map(|b| b.map_err(Into::into).boxed()))
}

/// The store: PostgreSQL when `DATABASE_URL` is set, otherwise in memory.
async fn store() -> Result<Arc<dyn Store>, Box<dyn Error>> {
    #[cfg(feature = "postgres")]
    if let Some(url) = std::env::var("DATABASE_URL").ok().filter(|u| !u.is_empty()) {
        let store = tower_idempotency::store::PostgresStore::connect(&url)?;
        // Creates the table if needed; safe to run from every replica at start-up.
        store.migrate().await?;
        println!("store: postgres, table {}", store.table());
        return Ok(Arc::new(store));
    }
    println!("store: memory (set DATABASE_URL to use PostgreSQL)");
    Ok(Arc::new(MemoryStore::new()))
}

/// The address from `--addr HOST:PORT`, by default 127.0.0.1:3000.
fn parse_addr() -> Result<SocketAddr, Box<dyn Error>> {
    let mut addr = SocketAddr::from(([127, 0, 0, 1], 3000));
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--addr" => addr = args.next().ok_or("--addr needs a value")?.parse()?,
            other => {
                return Err(format!(
                    "unknown argument {other:?}; usage: tower_service [--addr HOST:PORT]"
                )
                .into());
            }
        }
    }
    Ok(addr)
}
