//! What the layer and the job runner say of their work: one event per guarded request
//! (and per job) naming its outcome, at a level set by what it means to an operator;
//! and, with the `metrics` feature, the [metrics](crate::guide::observability) counted
//! and timed along the way. Without that feature the metrics calls here are empty.
//!
//! Levels (docs/observability.md says why): `debug` for a request whose handler ran,
//! as for any request (the app and its access log say the rest); `info` for a
//! duplicate answered in the handler's stead (a replay, a `409`) and for a request
//! refused before anything was claimed; `warn` for a key sent with a different request,
//! which only a client's bug does. A store error is logged at `error`, with its cause,
//! where it happens; its outcome event is at `debug`, not to say it twice.

use http::{Method, StatusCode};

use crate::{Outcome, rejection::Problem};

/// The mode a claim runs in: a field of the events, a label of the metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    Lease,
    Transactional,
}

impl Mode {
    pub(crate) fn of(transactional: bool) -> Self {
        if transactional {
            Self::Transactional
        } else {
            Self::Lease
        }
    }

    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Lease => "lease",
            Self::Transactional => "transactional",
        }
    }
}

/// What the outcome event of a guarded request says of it besides its outcome: its
/// method, the route it matched (axum's `MatchedPath`, when the layer is inside the
/// router: a template, never the path with its ids), and the layer's mode. Its key and
/// scope are the `idempotency` span's, as hashes, never in the event itself.
///
/// The events' fields and the metrics' labels are named by OpenTelemetry's HTTP
/// semantic conventions where those name them (`http.request.method`, `http.route`,
/// `http.response.status_code`), and under `idempotency.` where they do not.
pub(crate) struct Seen {
    method: Method,
    #[cfg(feature = "axum")]
    route: Option<axum::extract::MatchedPath>,
    mode: Mode,
}

impl Seen {
    pub(crate) fn of<B>(req: &http::Request<B>, mode: Mode) -> Self {
        Self {
            method: req.method().clone(),
            #[cfg(feature = "axum")]
            route: req.extensions().get().cloned(),
            mode,
        }
    }

    fn route(&self) -> Option<&str> {
        #[cfg(feature = "axum")]
        return self.route.as_ref().map(|r| r.as_str());
        #[cfg(not(feature = "axum"))]
        None
    }

    /// A guarded request answered with `outcome` and `status`; `None` for both: the
    /// inner service failed (it ran, and its key was released). Counted, and logged in
    /// the request's span.
    pub(crate) fn answered(&self, outcome: Option<Outcome>, status: Option<StatusCode>) {
        let outcome = outcome.unwrap_or(Outcome::Released);
        count(outcome, self.mode, &self.method, self.route(), status);
        let status = status.map(|s| s.as_u16());
        let (method, route, mode) = (method_name(&self.method), self.route(), self.mode.as_str());
        macro_rules! event {
            ($level:ident, $message:literal) => {
                tracing::event!(
                    tracing::Level::$level,
                    idempotency.outcome = outcome.as_str(),
                    http.response.status_code = status,
                    idempotency.mode = mode,
                    http.request.method = method,
                    http.route = route,
                    $message
                )
            };
        }
        match outcome {
            Outcome::Executed => event!(DEBUG, "the handler ran under the key"),
            Outcome::Released => event!(
                DEBUG,
                "the handler ran under the key; its answer was not stored, and the key was released"
            ),
            Outcome::Replayed => event!(INFO, "a duplicate got the stored response"),
            Outcome::Conflict => event!(INFO, "a duplicate came while its key's request ran"),
            Outcome::Mismatch => event!(WARN, "the key came with a different request"),
            Outcome::Rejected => event!(INFO, "refused before its key was claimed"),
            Outcome::StoreError => event!(DEBUG, "the store failed; answered 503"),
            Outcome::Expired => event!(
                WARN,
                "a late retry: its key was done and its response is gone; refused, not run again"
            ),
            // Not guarded here: an outer layer of the same mode guards it.
            Outcome::PassedThrough => {}
        }
    }

    /// A request refused for its key (`key-missing`, `key-malformed`), before there is
    /// a span: counted, and logged with the problem and why. `reason` names the fault,
    /// never the key.
    pub(crate) fn refused(&self, problem: Problem, reason: &str) {
        let status = problem.status();
        count(
            Outcome::Rejected,
            self.mode,
            &self.method,
            self.route(),
            Some(status),
        );
        tracing::info!(
            idempotency.outcome = Outcome::Rejected.as_str(),
            http.response.status_code = status.as_u16(),
            idempotency.problem = problem.slug(),
            idempotency.reason = reason,
            idempotency.mode = self.mode.as_str(),
            http.request.method = method_name(&self.method),
            http.route = self.route(),
            "refused for its idempotency key"
        );
    }
}

/// Counts a guarded request with `outcome` that has no event of its own: passed through
/// (no key, none required; or guarded by an outer layer), or refused where the refusal
/// is logged already; answered `status`, where it is known already.
pub(crate) fn count_request<B>(
    outcome: Outcome,
    mode: Mode,
    req: &http::Request<B>,
    status: Option<StatusCode>,
) {
    #[cfg(feature = "metrics")]
    {
        #[cfg(feature = "axum")]
        let route = req
            .extensions()
            .get::<axum::extract::MatchedPath>()
            .map(|r| r.as_str());
        #[cfg(not(feature = "axum"))]
        let route = None;
        count(outcome, mode, req.method(), route, status);
    }
    #[cfg(not(feature = "metrics"))]
    let _ = (outcome, mode, req, status);
}

/// Counts a guarded request: by outcome and mode, method, route (when known: a
/// template) and status (when there is one, and it is known).
fn count(
    outcome: Outcome,
    mode: Mode,
    method: &Method,
    route: Option<&str>,
    status: Option<StatusCode>,
) {
    #[cfg(feature = "metrics")]
    {
        use ::metrics::Label;
        let mut labels = Vec::with_capacity(5);
        labels.push(Label::new(crate::metrics::OUTCOME, outcome.as_str()));
        labels.push(Label::new(crate::metrics::MODE, mode.as_str()));
        labels.push(Label::new(crate::metrics::METHOD, method_name(method)));
        if let Some(route) = route {
            labels.push(Label::new(crate::metrics::ROUTE, route.to_owned()));
        }
        if let Some(status) = status {
            labels.push(Label::new(
                crate::metrics::STATUS,
                status.as_str().to_owned(),
            ));
        }
        ::metrics::counter!(crate::metrics::REQUESTS, labels).increment(1);
    }
    #[cfg(not(feature = "metrics"))]
    let _ = (outcome, mode, method, route, status);
}

/// The method as OpenTelemetry names it (`http.request.method`): one of RFC 9110's and
/// `PATCH`, or `_OTHER` for any other, so that the metrics' series stay bounded
/// whatever methods clients send.
fn method_name(method: &Method) -> &'static str {
    match *method {
        Method::GET => "GET",
        Method::HEAD => "HEAD",
        Method::POST => "POST",
        Method::PUT => "PUT",
        Method::DELETE => "DELETE",
        Method::CONNECT => "CONNECT",
        Method::OPTIONS => "OPTIONS",
        Method::TRACE => "TRACE",
        Method::PATCH => "PATCH",
        _ => "_OTHER",
    }
}

/// A job run ended with `outcome`; `result` names the `JobOutcome` or `JobError`
/// variant. Counted, and logged in the job's span, at the levels of the layer's
/// outcomes.
pub(crate) fn job_ended(outcome: Outcome, result: &'static str, mode: Mode) {
    #[cfg(feature = "metrics")]
    ::metrics::counter!(
        crate::metrics::JOBS,
        crate::metrics::OUTCOME => outcome.as_str(),
        crate::metrics::MODE => mode.as_str(),
    )
    .increment(1);
    let mode = mode.as_str();
    macro_rules! event {
        ($level:ident, $message:literal) => {
            tracing::event!(
                tracing::Level::$level,
                idempotency.outcome = outcome.as_str(),
                idempotency.result = result,
                idempotency.mode = mode,
                $message
            )
        };
    }
    match outcome {
        Outcome::Executed => event!(DEBUG, "the work ran under the key"),
        Outcome::Released => event!(
            DEBUG,
            "the work ran under the key and failed; the key was released"
        ),
        Outcome::Replayed => event!(INFO, "a redelivery got the stored result"),
        Outcome::Conflict => event!(INFO, "a redelivery came while its key's work ran"),
        Outcome::Mismatch => event!(WARN, "the key came with a different input"),
        Outcome::Rejected => event!(INFO, "refused before its key was claimed"),
        Outcome::StoreError => event!(DEBUG, "the store failed; the work did not run"),
        Outcome::Expired => event!(
            WARN,
            "a late redelivery: its key was done and its result is gone; not run again"
        ),
        Outcome::PassedThrough => {}
    }
}

/// Times a claim or a completion, for its histogram; nothing without the `metrics`
/// feature.
pub(crate) struct Timer {
    #[cfg(feature = "metrics")]
    started: std::time::Instant,
}

impl Timer {
    pub(crate) fn start() -> Self {
        Self {
            #[cfg(feature = "metrics")]
            started: std::time::Instant::now(),
        }
    }

    /// A claim (in transactional mode: the connection, `BEGIN` and the claim, a
    /// duplicate's wait on the first request's row included) got its answer, or was
    /// given up on.
    pub(crate) fn claimed(self, mode: Mode) {
        #[cfg(feature = "metrics")]
        ::metrics::histogram!(crate::metrics::CLAIM_DURATION, crate::metrics::MODE => mode.as_str())
            .record(self.started.elapsed());
        #[cfg(not(feature = "metrics"))]
        let _ = mode;
    }

    /// An attempt to store a result (in transactional mode: the completion and its
    /// `COMMIT`, a check of a `COMMIT` in doubt included) ended.
    pub(crate) fn completed(self, mode: Mode) {
        #[cfg(feature = "metrics")]
        ::metrics::histogram!(crate::metrics::COMPLETION_DURATION, crate::metrics::MODE => mode.as_str())
            .record(self.started.elapsed());
        #[cfg(not(feature = "metrics"))]
        let _ = mode;
    }
}

/// A store operation failed or got no answer in time: `claim`, `complete`, `commit`,
/// `release`, `renew` or `purge`. (Its cause is logged where it happened.)
pub(crate) fn store_failed(operation: &'static str) {
    #[cfg(feature = "metrics")]
    ::metrics::counter!(crate::metrics::STORE_ERRORS, crate::metrics::OPERATION => operation)
        .increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = operation;
}

/// A request waiting for a running duplicate: counted once when it starts to wait, and
/// in the gauge of those waiting until this is dropped.
pub(crate) struct Waiting(());

pub(crate) fn waiting() -> Waiting {
    #[cfg(feature = "metrics")]
    {
        ::metrics::counter!(crate::metrics::WAITS).increment(1);
        ::metrics::gauge!(crate::metrics::WAITING).increment(1.0);
    }
    Waiting(())
}

impl Drop for Waiting {
    fn drop(&mut self) {
        #[cfg(feature = "metrics")]
        ::metrics::gauge!(crate::metrics::WAITING).decrement(1.0);
    }
}

/// A purge deleted `rows` expired records.
pub(crate) fn purged(rows: u64) {
    #[cfg(feature = "metrics")]
    ::metrics::counter!(crate::metrics::PURGED).increment(rows);
    #[cfg(not(feature = "metrics"))]
    let _ = rows;
}
