//! What the layer and the job runner say of their work: one event per guarded request
//! (and per job) naming its outcome, at a level set by what it means to an operator.
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
        let outcome = outcome.unwrap_or(Outcome::Executed);
        count_request(outcome, self.mode);
        let status = status.map(|s| s.as_u16());
        let (method, route, mode) = (self.method.as_str(), self.route(), self.mode.as_str());
        macro_rules! event {
            ($level:ident, $message:literal) => {
                tracing::event!(
                    tracing::Level::$level,
                    outcome = outcome.as_str(),
                    status,
                    mode,
                    method,
                    route,
                    $message
                )
            };
        }
        match outcome {
            Outcome::Executed => event!(DEBUG, "the handler ran under the key"),
            Outcome::Replayed => event!(INFO, "a duplicate got the stored response"),
            Outcome::Conflict => event!(INFO, "a duplicate came while its key's request ran"),
            Outcome::Mismatch => event!(WARN, "the key came with a different request"),
            Outcome::Rejected => event!(INFO, "refused before its key was claimed"),
            Outcome::StoreError => event!(DEBUG, "the store failed; answered 503"),
            // Not guarded here: an outer layer of the same mode guards it.
            Outcome::PassedThrough => {}
        }
    }

    /// A request refused for its key (`key-missing`, `key-malformed`), before there is
    /// a span: counted, and logged with the problem and why. `reason` names the fault,
    /// never the key.
    pub(crate) fn refused(&self, problem: Problem, reason: &str) {
        count_request(Outcome::Rejected, self.mode);
        tracing::info!(
            outcome = Outcome::Rejected.as_str(),
            status = problem.status().as_u16(),
            problem = problem.slug(),
            reason,
            mode = self.mode.as_str(),
            method = self.method.as_str(),
            route = self.route(),
            "refused for its idempotency key"
        );
    }
}

/// Counts a request with `outcome` that has no event of its own: passed through (no
/// key, none required; or guarded by an outer layer), or refused where the refusal is
/// logged already.
pub(crate) fn count_request(outcome: Outcome, mode: Mode) {
    let _ = (outcome, mode);
}

/// A job run ended with `outcome`; `result` names the `JobOutcome` or `JobError`
/// variant. Logged in the job's span, at the levels of the layer's
/// outcomes.
pub(crate) fn job_ended(outcome: Outcome, result: &'static str, mode: Mode) {
    let mode = mode.as_str();
    macro_rules! event {
        ($level:ident, $message:literal) => {
            tracing::event!(
                tracing::Level::$level,
                outcome = outcome.as_str(),
                result,
                mode,
                $message
            )
        };
    }
    match outcome {
        Outcome::Executed => event!(DEBUG, "the work ran under the key"),
        Outcome::Replayed => event!(INFO, "a redelivery got the stored result"),
        Outcome::Conflict => event!(INFO, "a redelivery came while its key's work ran"),
        Outcome::Mismatch => event!(WARN, "the key came with a different input"),
        Outcome::Rejected => event!(INFO, "refused before its key was claimed"),
        Outcome::StoreError => event!(DEBUG, "the store failed; the work did not run"),
        Outcome::PassedThrough => {}
    }
}
