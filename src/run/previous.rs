//! Where a request's key may have been stored under the layer's earlier settings, and
//! the look-ups that find it there. A claim that takes its key new in its (scope,
//! stored key) has not seen the key's earlier forms: a deploy that changed how scopes
//! are computed (`previous_scope_with`) left it under the previous scope; encryption
//! turned on (`encrypt_responses`, `accept_clear_records`) left it in clear, where the
//! claim under the key's hash does not look. So the key is also looked for under each
//! earlier form of the pair, in this order:
//!
//! 1. in its own scope, in clear: a record from before encryption;
//! 2. in the previous scope, as the key is stored now (hashed, if the layer has keys):
//!    a record from before the scopes changed;
//! 3. in the previous scope, in clear: a record from before both.
//!
//! (2 and 3 where the previous scope differs from the request's; 1 and 3 while the keys
//! accept clear records. In one deploy history, 1 and 2 are never both filled: the
//! order is newest first either way.) The first record that stands in the request's
//! way answers it, as a claim that found it would (replayed, `409`, `422`), its response
//! opened as the record of the scope and key it was found under (a seal is bound to
//! them): one that does not open is `500 response-unreadable`. The claim taken is let
//! go (its lease released, or its transaction rolled back).
//!
//! Costs: nothing for a request whose claim found its key (a replay, a `409`, a `422`),
//! nothing when neither setting is on, and for a key new in its scope one primary-key
//! read per form above, stopping at the first that stands: at most 1 with one of the
//! settings, 3 with both.

use std::time::Duration;

use http::{Response, request::Parts};

use super::{decision::opened_or_answer, sealing::Sealing};
use crate::{
    Fingerprint, Scope,
    answers::unavailable,
    body::ResponseBody,
    job::{JobError, JobOutcome},
    layer::Config,
    shutdown::InFlight,
    store::{Claim, ClaimRequest, KeyRecord, KeyState, Lease, Store, StoreError, within},
};

/// One earlier form of a request's key: the scope and the key as a record would hold
/// them.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Form<'a> {
    scope: Scope,
    key: &'a str,
    /// What the form is, for the logs.
    what: &'static str,
}

impl<'a> Form<'a> {
    /// `request` as if made for this form: what a record found here is opened as.
    fn request(&'a self, request: &ClaimRequest<'_>) -> ClaimRequest<'a> {
        ClaimRequest {
            scope: &self.scope,
            key: self.key,
            fingerprint: request.fingerprint,
            lease: request.lease,
            ttl: request.ttl,
        }
    }
}

/// The earlier forms of a request's key, in the order they are looked through.
#[derive(Debug, Default)]
pub(crate) struct Earlier<'a>(Vec<Form<'a>>);

impl<'a> Earlier<'a> {
    /// For a request in `scope` whose key is `key` (the client's) and `stored` (as the
    /// store holds it now, `sealing` deciding), with the scope `previous` the layer
    /// gave it before, if that differs. Allocates nothing when there is none.
    pub(crate) fn new(
        scope: &Scope,
        previous: Option<Scope>,
        stored: &'a str,
        key: &'a str,
        sealing: &Sealing,
    ) -> Self {
        let clear = sealing.looks_up_clear_keys() && stored != key;
        let mut forms = Vec::new();
        if clear {
            forms.push(Form {
                scope: scope.clone(),
                key,
                what: "in clear, from before encryption",
            });
        }
        if let Some(previous) = previous.filter(|previous| previous != scope) {
            if clear {
                forms.push(Form {
                    scope: previous.clone(),
                    key: stored,
                    what: "under the previous scope",
                });
                forms.push(Form {
                    scope: previous,
                    key,
                    what: "in clear under the previous scope, from before encryption",
                });
            } else {
                forms.push(Form {
                    scope: previous,
                    key: stored,
                    what: "under the previous scope",
                });
            }
        }
        Self(forms)
    }

    /// For a request of a layer: its previous scope from `previous_scope_with`.
    fn of_layer(config: &Config, parts: &Parts, request: &ClaimRequest<'a>, key: &'a str) -> Self {
        let previous = config.scoping.previous_of(parts, request.scope);
        Self::new(request.scope, previous, request.key, key, &config.sealing)
    }

    /// The first form whose record stands in the way of a request of `fingerprint`,
    /// read with `reader` one after the other, and what a claim that found it would
    /// say; `None` when none does.
    async fn first_standing(
        &self,
        reader: Reader<'_>,
        fingerprint: Fingerprint,
    ) -> Result<Option<(&Form<'a>, Claim)>, StoreError> {
        for form in &self.0 {
            let record = reader.look_up(&form.scope, form.key).await?;
            if let Some(claim) = standing(record, fingerprint) {
                tracing::debug!(
                    found = form.what,
                    "the key holds a record where the layer stored it before; answered from there"
                );
                return Ok(Some((form, claim)));
            }
        }
        Ok(None)
    }

    /// [`first_standing`](Self::first_standing) within `bound` (the look-ups
    /// together), a failure logged; `Ok(None)` at once when there is nothing to read.
    async fn looked_up(
        &self,
        reader: Reader<'_>,
        fingerprint: Fingerprint,
        bound: Duration,
    ) -> Result<Option<(&Form<'a>, Claim)>, StoreError> {
        if self.0.is_empty() {
            return Ok(None);
        }
        let looking = self.first_standing(reader, fingerprint);
        let looked = within(bound, "the look-ups of the key's earlier forms", looking).await;
        if let Err(e) = &looked {
            crate::observe::store_failed("look_up");
            tracing::error!(
                error = %e,
                "looking the key up where the layer stored it before (the previous scope, or in clear from before encryption) failed; nothing was run"
            );
        }
        looked
    }

    /// The answer to a request in the handler's stead, if an earlier form holds its
    /// key: a replay, `409`, `422`, `500 response-unreadable`; `503` if the store did
    /// not answer.
    async fn answer<B>(
        &self,
        config: &Config,
        reader: Reader<'_>,
        request: &ClaimRequest<'_>,
        key: &str,
        bound: Duration,
    ) -> Option<Response<ResponseBody<B>>> {
        match self.looked_up(reader, request.fingerprint, bound).await {
            Ok(None) => None,
            // Never a lease: the record is another claim's.
            Ok(Some((form, claim))) => Some(
                opened_or_answer(claim, &form.request(request), key, config)
                    .err()
                    .unwrap_or_else(|| unavailable(&config.problems)),
            ),
            Err(_) => Some(unavailable(&config.problems)),
        }
    }
}

/// How the look-ups read: through the store, or on the connection whose transaction
/// holds the claim (a record another transaction has not committed is not seen).
#[derive(Clone, Copy)]
pub(crate) enum Reader<'a> {
    Store(&'a dyn Store),
    #[cfg(feature = "postgres")]
    Transaction(
        &'a crate::store::PostgresStore,
        &'a crate::store::transaction::Checkout,
    ),
}

impl<'a> Reader<'a> {
    /// Reads on the connection of the claim's transaction, where its driver reads
    /// there (tokio-postgres); on sqlx, through the store: the look-ups read other
    /// keys than the claim's, committed ones, which a read committed transaction and
    /// the pool see alike.
    #[cfg(feature = "postgres")]
    pub(crate) fn in_transaction(
        store: &'a crate::store::transaction::TxStore,
        conn: &'a crate::store::transaction::TxConn,
    ) -> Self {
        use crate::store::transaction::{TxConn, TxStore};
        match (store, conn) {
            (TxStore::Postgres(store), TxConn::Deadpool(conn)) => Self::Transaction(store, conn),
            #[cfg(feature = "sqlx")]
            _ => Self::Store(store.as_store()),
        }
    }

    async fn look_up(&self, scope: &Scope, key: &str) -> Result<Option<KeyRecord>, StoreError> {
        match self {
            Self::Store(store) => store.look_up(scope, key).await,
            #[cfg(feature = "postgres")]
            Self::Transaction(store, conn) => store.look_up_on(conn, scope, key).await,
        }
    }
}

/// Lease mode: `lease` took the request's key new in its scope. If an earlier form
/// holds the key, the answer in the handler's stead, the lease then released; `None`:
/// run it.
pub(crate) async fn answer_in_lease<B>(
    config: &Config,
    parts: &Parts,
    request: &ClaimRequest<'_>,
    key: &str,
    lease: &Lease,
    in_flight: &InFlight,
) -> Option<Response<ResponseBody<B>>> {
    let earlier = Earlier::of_layer(config, parts, request, key);
    // The lease is not renewed yet: look-ups slower than a renewal's bound would leave
    // it to lapse before the handler starts, and a retry could take the key over.
    let bound = config.store_timeout.min(config.lease / 3);
    let reader = Reader::Store(&*config.store);
    let answer = earlier.answer(config, reader, request, key, bound).await?;
    config.leased().release(lease, in_flight.clone()).await;
    Some(answer)
}

/// Transactional mode: the request's key was claimed new in the transaction on
/// `conn`. If an earlier form holds the key (a committed record), the answer in the
/// handler's stead, for the caller to roll the transaction back; `None`: run it.
#[cfg(feature = "postgres")]
pub(crate) async fn answer_in_transaction<B>(
    config: &Config,
    (store, conn): (
        &crate::store::transaction::TxStore,
        &crate::store::transaction::TxConn,
    ),
    parts: &Parts,
    request: &ClaimRequest<'_>,
    key: &str,
) -> Option<Response<ResponseBody<B>>> {
    let earlier = Earlier::of_layer(config, parts, request, key);
    let reader = Reader::in_transaction(store, conn);
    let bound = config.store_timeout;
    earlier.answer(config, reader, request, key, bound).await
}

/// A job whose claim took its key new (a runner has no previous scope: its caller
/// names the scope): if the key holds a record in clear, from before encryption, what
/// the run returns, its claim then let go by the caller; `None`: run it.
pub(crate) async fn job_answer<E>(
    sealing: &Sealing,
    reader: Reader<'_>,
    request: &ClaimRequest<'_>,
    key: &str,
    bound: Duration,
) -> Option<Result<JobOutcome, JobError<E>>> {
    let earlier = Earlier::new(request.scope, None, request.key, key, sealing);
    let (form, claim) = match earlier.looked_up(reader, request.fingerprint, bound).await {
        Ok(found) => found?,
        Err(e) => return Some(Err(JobError::Store(e))),
    };
    Some(
        match super::job::found(claim, &form.request(request), key, sealing) {
            Ok(Err(outcome)) => Ok(outcome),
            Err(e) => Err(e),
            // Never a lease: the record is another claim's.
            Ok(Ok(_)) => Err(JobError::Store(StoreError::new(
                crate::store::StoreErrorKind::Other,
                "a look-up answered a lease",
            ))),
        },
    )
}

/// What a record found in an earlier form means for a request of `fingerprint`, as a
/// claim that found it would say; `None` when nothing stops the request from running:
/// no record, one a claim would take afresh (past its TTL), or a lapsed lease of the
/// same request, which a claim would take over and run again.
fn standing(record: Option<KeyRecord>, fingerprint: Fingerprint) -> Option<Claim> {
    let record = record?;
    if record.is_free() {
        return None;
    }
    match record.state {
        KeyState::Running { lease_left }
            if lease_left.is_zero() && fingerprint.matches(&record.fingerprint) =>
        {
            None
        }
        KeyState::Running { lease_left } => Some(Claim::Running {
            fingerprint: record.fingerprint,
            retry_after: lease_left,
        }),
        KeyState::Completed { response } => Some(Claim::Completed {
            fingerprint: record.fingerprint,
            response,
        }),
        // Its response gone, the key remembered under this earlier form: refused as a
        // claim that found it under the new one would be (`410 response-expired`).
        KeyState::Remembered { status } => {
            let now = std::time::SystemTime::now();
            Some(Claim::Remembered {
                fingerprint: record.fingerprint,
                status,
                completed_at: record.completed_at.unwrap_or(now),
                remembered_until: now + record.expires_in,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{StoredResponse, store::FencingToken};

    const MINE: Fingerprint = Fingerprint::new([1; 32]);
    const OTHER: Fingerprint = Fingerprint::new([2; 32]);
    const LIVE: Duration = Duration::from_secs(60);

    fn running(fingerprint: Fingerprint, lease_left: Duration, expires_in: Duration) -> KeyRecord {
        KeyRecord::running(FencingToken::new(1), fingerprint, lease_left, expires_in)
    }

    fn completed(fingerprint: Fingerprint, expires_in: Duration) -> KeyRecord {
        let response = StoredResponse {
            status: http::StatusCode::CREATED,
            headers: http::HeaderMap::new(),
            body: "done".into(),
        };
        KeyRecord::completed(FencingToken::new(1), fingerprint, response, expires_in)
    }

    #[test]
    fn a_record_stands_as_a_claim_that_found_it_would_take_it() {
        assert!(standing(None, MINE).is_none());
        assert!(matches!(
            standing(Some(completed(MINE, LIVE)), MINE),
            Some(Claim::Completed { fingerprint, .. }) if fingerprint == MINE
        ));
        assert!(matches!(
            standing(Some(completed(OTHER, LIVE)), MINE),
            Some(Claim::Completed { fingerprint, .. }) if fingerprint == OTHER
        ));
        assert!(matches!(
            standing(Some(running(MINE, LIVE, LIVE)), MINE),
            Some(Claim::Running {
                retry_after: LIVE,
                ..
            })
        ));
        // A lapsed lease: the same request would take it over; another is refused.
        assert!(standing(Some(running(MINE, Duration::ZERO, LIVE)), MINE).is_none());
        assert!(matches!(
            standing(Some(running(OTHER, Duration::ZERO, LIVE)), MINE),
            Some(Claim::Running { fingerprint, .. }) if fingerprint == OTHER
        ));
        // Past its TTL: as if there were none.
        assert!(standing(Some(completed(OTHER, Duration::ZERO)), MINE).is_none());
        assert!(standing(Some(running(OTHER, Duration::ZERO, Duration::ZERO)), MINE).is_none());
        // A live lease keeps its record past the TTL.
        assert!(standing(Some(running(MINE, LIVE, Duration::ZERO)), MINE).is_some());
        // A remembered key stands while it is remembered, for any request (the
        // decision tells the same request's 410 from another's 422); then it is gone.
        let remembered = |left| {
            KeyRecord::remembered(FencingToken::new(1), MINE, http::StatusCode::CREATED, left)
        };
        assert!(matches!(
            standing(Some(remembered(LIVE)), OTHER),
            Some(Claim::Remembered { fingerprint, .. }) if fingerprint == MINE
        ));
        assert!(standing(Some(remembered(Duration::ZERO)), MINE).is_none());
    }

    /// A record of the previous scope made under the bytes scheme (before the JSON
    /// scheme) stands as the same request's for a JSON-scheme request that made it.
    #[test]
    fn a_record_made_under_the_bytes_scheme_is_compared_its_way() {
        use crate::FingerprintScheme;
        use http::header::CONTENT_TYPE;
        let parts = http::Request::post("/p")
            .header(CONTENT_TYPE, "application/json")
            .body(())
            .unwrap()
            .into_parts()
            .0;
        let body = br#"{"a":1}"#;
        let request = FingerprintScheme::Json.fingerprint(&parts, &[CONTENT_TYPE], body);
        let before = FingerprintScheme::Bytes.fingerprint(&parts, &[CONTENT_TYPE], body);
        // A lapsed lease of the same request: taken over, not standing.
        assert!(standing(Some(running(before, Duration::ZERO, LIVE)), request).is_none());
        assert!(standing(Some(running(OTHER, Duration::ZERO, LIVE)), request).is_some());
    }

    /// The forms looked through: none without either setting; one with either; three,
    /// newest first, with both; the previous scope only where it differs.
    #[test]
    fn the_earlier_forms_are_those_the_settings_can_have_left_newest_first() {
        let (scope, previous) = (Scope::new("principal:acct"), Scope::new("auth:abc"));
        let keys = crate::encryption::EncryptionKeys::new(1, [1; 32]);
        let stored = keys.stored_key("k");
        let forms = |earlier: Earlier<'_>| -> Vec<(String, String)> {
            let forms = earlier.0.iter();
            forms
                .map(|f| (f.scope.as_str().to_owned(), f.key.to_owned()))
                .collect()
        };
        let none = Sealing::default();
        assert!(forms(Earlier::new(&scope, None, "k", "k", &none)).is_empty());
        assert!(forms(Earlier::new(&scope, Some(scope.clone()), "k", "k", &none)).is_empty());
        assert_eq!(
            forms(Earlier::new(
                &scope,
                Some(previous.clone()),
                "k",
                "k",
                &none
            )),
            [("auth:abc".into(), "k".into())]
        );
        let sealing = Sealing::new(keys.clone());
        assert_eq!(
            forms(Earlier::new(&scope, None, &stored, "k", &sealing)),
            [("principal:acct".into(), "k".into())]
        );
        assert_eq!(
            forms(Earlier::new(
                &scope,
                Some(previous.clone()),
                &stored,
                "k",
                &sealing
            )),
            [
                ("principal:acct".into(), "k".into()),
                ("auth:abc".into(), stored.clone()),
                ("auth:abc".into(), "k".into()),
            ]
        );
        // Clear records no longer accepted: the previous scope, as keys are stored now.
        let sealed_only = Sealing::new(keys.accept_clear_records(false));
        assert_eq!(
            forms(Earlier::new(
                &scope,
                Some(previous),
                &stored,
                "k",
                &sealed_only
            )),
            [("auth:abc".into(), stored.clone())]
        );
        assert!(forms(Earlier::new(&scope, None, &stored, "k", &sealed_only)).is_empty());
    }
}
