//! Metrics through the [`metrics`](https://docs.rs/metrics/0.24) facade (feature
//! `metrics`): what the layer and the job runner do, counted and timed, for whatever
//! recorder the app installs (a Prometheus exporter, StatsD, OpenTelemetry).
//!
//! Without a recorder installed the calls cost little (a guarded request's labels are
//! built, a route's and a status's copied); without the feature they are not compiled
//! in. The names, their labels and what they count are in the
//! table of [the observability guide](crate::guide::observability#metrics), and here
//! as constants. [`describe`] gives each its unit and description, for exporters that
//! print them (Prometheus's `# HELP`).
//!
//! ```
//! use axum::{Router, routing::post};
//! use tower_idempotency::{IdempotencyLayer, store::MemoryStore};
//!
//! // Once, after installing the app's recorder (e.g. metrics-exporter-prometheus's
//! // `PrometheusBuilder::install_recorder()`):
//! tower_idempotency::metrics::describe();
//! let app: Router = Router::new()
//!     .route("/payments", post(|| async { "charged" }))
//!     .layer(IdempotencyLayer::new(MemoryStore::new()));
//! ```
//!
//! The repository's `examples/metrics-exporter` (`cargo run -p example-metrics-exporter`)
//! drives a few requests and prints what a Prometheus scrape would read.

use ::metrics::{Unit, describe_counter, describe_gauge, describe_histogram};

/// Counter: guarded requests, by [`OUTCOME`] and [`MODE`], [`METHOD`], [`ROUTE`] (when
/// the layer runs inside an axum router) and [`STATUS`] (when the request was
/// answered with one: not for a request passed through, nor an inner service's error).
pub const REQUESTS: &str = "idempotency_requests_total";

/// Counter: [`JobRunner`](crate::job::JobRunner) runs, by [`OUTCOME`] and [`MODE`].
pub const JOBS: &str = "idempotency_jobs_total";

/// Histogram, seconds: a claim, by [`MODE`].
pub const CLAIM_DURATION: &str = "idempotency_claim_duration_seconds";

/// Histogram, seconds: an attempt to store a result, by [`MODE`].
pub const COMPLETION_DURATION: &str = "idempotency_completion_duration_seconds";

/// Counter: store operations that failed or got no answer in time, by [`OPERATION`].
pub const STORE_ERRORS: &str = "idempotency_store_errors_total";

/// Label: what the layer did with a request (an [`Outcome`](crate::Outcome) name:
/// `executed`, `released`, `replayed`, …), or the job runner with a run.
pub const OUTCOME: &str = "idempotency.outcome";

/// Label: the mode, `lease` or `transactional`.
pub const MODE: &str = "idempotency.mode";

/// Label: the store operation that failed: `claim`, `complete`, `commit`, `release`,
/// `renew`, `purge`, `look_up`.
pub const OPERATION: &str = "idempotency.operation";

/// Label, OpenTelemetry's: the request's method (`POST`, or `_OTHER` for a method
/// RFC 9110 does not name, nor `PATCH`).
pub const METHOD: &str = "http.request.method";

/// Label, OpenTelemetry's: the route the request matched, as a template
/// (`/payments/{id}`), never the path.
pub const ROUTE: &str = "http.route";

/// Label, OpenTelemetry's: the status answered (`201`, `409`, `500`).
pub const STATUS: &str = "http.response.status_code";

/// Counter: requests that waited for a running duplicate (`wait_for_running`).
pub const WAITS: &str = "idempotency_waits_total";

/// Gauge: requests waiting for a running duplicate now.
pub const WAITING: &str = "idempotency_waiting";

/// Counter: expired records deleted by a background purge.
pub const PURGED: &str = "idempotency_purged_total";

/// Describes every metric of this crate to the installed recorder: its unit and what
/// it counts. Call it once, after installing the recorder; the metrics are recorded
/// whether or not it is called.
pub fn describe() {
    describe_counter!(
        REQUESTS,
        Unit::Count,
        "Guarded requests, by the layer's outcome and mode, method, route and status."
    );
    describe_counter!(JOBS, Unit::Count, "JobRunner runs, by outcome and mode.");
    describe_histogram!(
        CLAIM_DURATION,
        Unit::Seconds,
        "Time to claim a key in the store (transactional mode: connection, BEGIN and claim)."
    );
    describe_histogram!(
        COMPLETION_DURATION,
        Unit::Seconds,
        "Time of one attempt to store a result (transactional mode: completion and COMMIT)."
    );
    describe_counter!(
        STORE_ERRORS,
        Unit::Count,
        "Store operations that failed or timed out, by operation."
    );
    describe_counter!(
        WAITS,
        Unit::Count,
        "Requests that waited for a running duplicate to finish."
    );
    describe_gauge!(
        WAITING,
        Unit::Count,
        "Requests waiting for a running duplicate now."
    );
    describe_counter!(
        PURGED,
        Unit::Count,
        "Expired idempotency records deleted by background purges."
    );
}
