//! [`IdempotencyLayer`]: the configuration, shared by every service it wraps.

use std::{sync::Arc, time::Duration};

use bytes::Bytes;
use http::{HeaderMap, HeaderName, Method, StatusCode, header, request::Parts};
use tower_layer::Layer;

#[cfg(doc)]
use crate::Principal;
#[cfg(feature = "postgres")]
use crate::settings::LONGEST_LOCK_TIMEOUT;
use crate::{
    Fingerprint, FingerprintScheme, Idempotency, Scope, ShutdownHandle,
    policy::{PolicyFn, default_storage_policy},
    rejection::{Problems, Rejection},
    request::fingerprint::Fingerprinter,
    request::scoping::Scoping,
    settings::{self, MILLISECOND, SHORTEST_LEASE, TEN_YEARS},
    store::{IntoStore, Store},
};

/// The largest `response_body_limit`: a stored response must fit in one PostgreSQL
/// value (1 GB), with room for its headers.
const LARGEST_STORED_BODY: usize = 512 * 1024 * 1024;

/// Makes `Idempotency-Key` work: claims each key atomically before the handler runs,
/// stores the response, and replays it to duplicates.
///
/// Requests on a guarded method (POST and PATCH by default) that carry the header are
/// claimed in the store; everything else passes straight through. Cloning is cheap: the
/// configuration is shared.
///
/// # Examples
///
/// ```
/// use axum::{Router, routing::post};
/// use std::time::Duration;
/// use tower_idempotency::{IdempotencyLayer, IdempotencyKey, store::MemoryStore};
///
/// async fn create_payment(key: IdempotencyKey) -> String {
///     format!("charged once for {key}")
/// }
///
/// let app: Router = Router::new()
///     .route("/payments", post(create_payment))
///     .layer(
///         IdempotencyLayer::new(MemoryStore::new())
///             .require_key(true)
///             .ttl(Duration::from_secs(24 * 3600)),
///     );
/// ```
///
/// With PostgreSQL, pass a [`PostgresStore`](crate::store::PostgresStore), or the
/// app's `deadpool_postgres::Pool` for the default table, and run
/// [`migrate`](Self::migrate) once at start-up.
#[derive(Clone)]
pub struct IdempotencyLayer {
    pub(crate) config: Arc<Config>,
}

/// What removes headers before a response is stored
/// ([`IdempotencyLayer::unreplayed_headers_with`]).
pub(crate) type HeaderFilter = Arc<dyn Fn(&mut HeaderMap) + Send + Sync>;

#[derive(Clone)]
pub(crate) struct Config {
    pub(crate) store: Arc<dyn Store>,
    pub(crate) methods: Vec<Method>,
    pub(crate) require_key: bool,
    pub(crate) header: HeaderName,
    pub(crate) lease: Duration,
    pub(crate) ttl: Duration,
    pub(crate) request_body_limit: usize,
    pub(crate) response_body_limit: usize,
    pub(crate) store_timeout: Duration,
    pub(crate) scoping: Scoping,
    pub(crate) fingerprinter: Fingerprinter,
    pub(crate) policy: PolicyFn,
    pub(crate) unreplayed_headers: HeaderFilter,
    pub(crate) store_bodies: bool,
    pub(crate) shutdown: ShutdownHandle,
    pub(crate) wait: Duration,
    pub(crate) in_progress_retry_after: Duration,
    pub(crate) request_body_timeout: Duration,
    pub(crate) response_body_timeout: Duration,
    pub(crate) hash_keys_in_traces: bool,
    pub(crate) problems: Arc<Problems>,
    pub(crate) sealing: crate::run::sealing::Sealing,
    /// Renews the leases of the layer's running claims, one task per runtime.
    pub(crate) renewals: crate::run::renewal::Renewals,
    #[cfg(feature = "postgres")]
    pub(crate) transactional: Option<crate::store::transaction::TxStore>,
    #[cfg(feature = "postgres")]
    pub(crate) lock_timeout: Duration,
    /// Registered as resumable: each claim's request kept for a completer.
    pub(crate) resumable: Option<crate::run::completer::Resumable>,
}

impl Config {
    /// What a run under a lease needs from this layer: its store and timing.
    pub(crate) fn leased(&self) -> crate::run::Leased {
        crate::run::Leased {
            store: self.store.clone(),
            lease: self.lease,
            ttl: self.ttl,
            store_timeout: self.store_timeout,
            sealing: self.sealing.clone(),
            renewals: self.renewals.clone(),
        }
    }

    /// Whether requests are guarded in transactional mode.
    pub(crate) fn is_transactional(&self) -> bool {
        #[cfg(feature = "postgres")]
        return self.transactional.is_some();
        #[cfg(not(feature = "postgres"))]
        return false;
    }
}

impl IdempotencyLayer {
    /// A layer over `store` with the defaults: POST and PATCH guarded, key optional,
    /// 30 s lease (renewed while the handler runs), 24 h TTL, 1 MiB request and stored
    /// response limits, 5 s store timeout, scope from the request's [`Principal`]
    /// (else from `Authorization`), fingerprint over `Content-Type` and the body,
    /// `Set-Cookie` not stored.
    pub fn new(store: impl IntoStore) -> Self {
        Self {
            config: Arc::new(Config {
                store: store.into_store(),
                methods: vec![Method::POST, Method::PATCH],
                require_key: false,
                header: crate::IDEMPOTENCY_KEY,
                lease: Duration::from_secs(30),
                ttl: Duration::from_secs(24 * 3600),
                request_body_limit: 1024 * 1024,
                response_body_limit: 1024 * 1024,
                store_timeout: Duration::from_secs(5),
                scoping: Scoping::default(),
                fingerprinter: Fingerprinter::default(),
                policy: Arc::new(default_storage_policy),
                unreplayed_headers: Arc::new(|headers: &mut HeaderMap| {
                    headers.remove(header::SET_COOKIE);
                }),
                store_bodies: true,
                shutdown: ShutdownHandle::default(),
                wait: Duration::ZERO,
                in_progress_retry_after: Duration::from_secs(1),
                request_body_timeout: Duration::from_secs(30),
                response_body_timeout: Duration::from_secs(30),
                hash_keys_in_traces: true,
                problems: Arc::default(),
                sealing: crate::run::sealing::Sealing::default(),
                renewals: crate::run::renewal::Renewals::default(),
                #[cfg(feature = "postgres")]
                transactional: None,
                #[cfg(feature = "postgres")]
                lock_timeout: Duration::from_secs(5),
                resumable: None,
            }),
        }
    }

    /// A layer in transactional mode over `store`: each guarded request runs in a
    /// transaction that holds its claim, the handler's own writes (through the
    /// [`TransactionHandle`](crate::transactional::TransactionHandle)) and its stored
    /// response, committed together. See [`transactional`](crate::transactional).
    ///
    /// `store` is a [`PostgresStore`](crate::store::PostgresStore), or the app's
    /// `deadpool_postgres::Pool` (the table `public.idempotency_keys`), as for
    /// [`new`](Self::new); with the `sqlx` feature, a
    /// [`SqlxStore`](crate::store::SqlxStore) or the app's `sqlx::PgPool`, whose
    /// handlers get the transaction as a
    /// [`SqlxTransaction`](crate::transactional::SqlxTransaction):
    ///
    /// ```no_run
    /// use tower_idempotency::{IdempotencyLayer, store::pool_for_url};
    ///
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// let pool = pool_for_url("postgres://postgres@127.0.0.1/postgres", 16)?;
    /// let layer = IdempotencyLayer::transactional(pool.clone()); // the app keeps `pool`
    /// layer.migrate().await?;
    /// # Ok(()) }
    /// ```
    #[cfg(feature = "postgres")]
    pub fn transactional(store: impl Into<crate::store::TransactionalStore>) -> Self {
        use crate::store::transaction::TxStore;
        let store = store.into().0;
        let mut layer = match &store {
            TxStore::Postgres(store) => Self::new(store.clone()),
            #[cfg(feature = "sqlx")]
            TxStore::Sqlx(store) => Self::new(store.clone()),
        };
        layer.config().transactional = Some(store);
        layer
    }

    /// Transactional mode: how long the handler's own statements wait for a row lock
    /// (default 5 s; PostgreSQL's `lock_timeout`, from 1 ms to 24.8 days): it is set for
    /// the transaction once its key is claimed, in the claim's round trip, so a
    /// `SELECT … FOR UPDATE` on a busy row fails with SQLSTATE 55P03 past it; a handler
    /// that needs longer runs `SET LOCAL lock_timeout` on its
    /// [`TransactionHandle`](crate::transactional::TransactionHandle).
    ///
    /// It does not bound how long a duplicate waits on the first request's uncommitted
    /// claim: that is [`wait_for_running`](Self::wait_for_running) (by default a
    /// moment, then `409`).
    #[cfg(feature = "postgres")]
    #[must_use]
    pub fn lock_timeout(mut self, timeout: Duration) -> Self {
        self.config().lock_timeout = timeout.clamp(MILLISECOND, LONGEST_LOCK_TIMEOUT);
        self
    }

    fn config(&mut self) -> &mut Config {
        Arc::make_mut(&mut self.config)
    }

    /// The methods whose requests are guarded (default POST and PATCH). Requests with
    /// other methods pass through untouched.
    #[must_use]
    pub fn methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.config().methods = methods.into_iter().collect();
        self
    }

    /// Whether guarded requests without a key get 400 (default `false`: they pass through).
    #[must_use]
    pub fn require_key(mut self, required: bool) -> Self {
        self.config().require_key = required;
        self
    }

    /// The header that carries the key (default `Idempotency-Key`).
    #[must_use]
    pub fn header_name(mut self, name: HeaderName) -> Self {
        self.config().header = name;
        self
    }

    /// How long a claim holds before a retry may take it over if its holder stops
    /// renewing it (default 30 s; at least 10 ms). A live handler's lease is renewed
    /// every third of this, so it bounds how long a crashed request blocks its key, not
    /// how long a handler may run.
    ///
    /// The renewals are sent by a task of their own (one per runtime for all of the
    /// layer's running claims), not by the future that polls the handler: a handler that blocks its thread for a while (a blocking SDK call,
    /// bcrypt, a PDF render) keeps its lease too, as long as the runtime has another
    /// worker thread to renew on (on a current-thread runtime nothing else runs while a
    /// handler blocks, renewals included). Block in `tokio::task::block_in_place` or
    /// `spawn_blocking`: a worker blocked outright also holds up the tasks it had
    /// queued, and with them, possibly, the database connections a renewal needs.
    ///
    /// Each renewal is given up after a third of the lease: keep the lease many times
    /// the store's round trip (seconds, not milliseconds). A lease too short for its
    /// renewals lapses under a live handler, and a retry then takes the key over and
    /// runs the handler a second time. (`PostgresStore` does not make renewals wait
    /// for a pooled connection behind the handlers: with none idle, they go over
    /// connections it keeps outside the pool.)
    #[must_use]
    pub fn lease_duration(mut self, lease: Duration) -> Self {
        self.config().lease = settings::duration(lease, SHORTEST_LEASE);
        self
    }

    /// How long a duplicate waits for a running request with its key to finish, then
    /// replays its response (default zero: answer 409 at once; at most 10 years). Past
    /// the bound, 409.
    ///
    /// Wake-ups are pushed by the store: the memory store in-process, `PostgresStore`
    /// through `LISTEN/NOTIFY`, so a duplicate on one replica wakes when the first
    /// request completes on another (give the store a notification connection, see
    /// [`PostgresStore::with_notifications`](crate::store::PostgresStore::with_notifications)).
    /// A waiter also looks again when the running request's lease lapses (its process
    /// may have crashed, and then notifies nobody), and stops with `503 shutting-down`
    /// when the layer's [`ShutdownHandle`] closes.
    ///
    /// In transactional mode a duplicate waits on the first request's uncommitted row
    /// instead, holding a connection, for this bound (at most 24.8 days), then replays
    /// the committed response or answers 409. With the default of zero it waits a moment
    /// (50 ms, a claim that merely crosses the first one's commit), so its 409 comes at
    /// once and it holds its connection no longer. The handler's own lock waits keep
    /// [`lock_timeout`](Self::lock_timeout), set in the claim's round trip.
    ///
    /// Keep the bound below your clients' read timeout (a 2 s read timeout is common):
    /// a duplicate that waits longer than its client does is answered to nobody, and
    /// the client retries into another wait.
    #[must_use]
    pub fn wait_for_running(mut self, bound: Duration) -> Self {
        self.config().wait = bound.min(TEN_YEARS);
        self
    }

    /// The `Retry-After` a duplicate of a running request is told with its
    /// `409 in-progress` (default 1 s; at most 10 years): the time after which the
    /// client should look again. It is never more than what is left of the running
    /// request's lease (in whole seconds, rounded up, at least 1): a holder that
    /// crashed frees its key then.
    ///
    /// Most handlers finish in well under a second, so a hint of the whole lease (30 s
    /// by default) would keep a well-behaved client waiting long after the response
    /// was stored. Raise it for routes whose handlers take longer, so that clients do
    /// not poll; or let duplicates wait for the result instead
    /// ([`wait_for_running`](Self::wait_for_running)).
    #[must_use]
    pub fn in_progress_retry_after(mut self, hint: Duration) -> Self {
        self.config().in_progress_retry_after = hint.min(TEN_YEARS);
        self
    }

    /// How long a stored response is replayed (default 24 h; from 1 ms to 10 years). The
    /// TTL counts from completion; a running request's record lives at least as long as
    /// its lease, however short the TTL.
    #[must_use]
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.config().ttl = settings::duration(ttl, MILLISECOND);
        self
    }

    /// The largest request body read for a guarded request (default 1 MiB); larger ones
    /// get 413 and claim nothing.
    #[must_use]
    pub fn request_body_limit(mut self, bytes: usize) -> Self {
        self.config().request_body_limit = bytes;
        self
    }

    /// How long reading a guarded request's body may take (default 30 s; from 1 ms to 10
    /// years). A body that never ends, or a client that sends it too slowly, gets
    /// `408 body-timeout`, and nothing is claimed.
    #[must_use]
    pub fn request_body_timeout(mut self, timeout: Duration) -> Self {
        self.config().request_body_timeout = settings::duration(timeout, MILLISECOND);
        self
    }

    /// Whether the `idempotency` tracing span carries a hash of the key instead of the
    /// key itself (default `true`: the first 16 hex digits of its SHA-256, enough to
    /// correlate a client's retries, not to recover the key).
    ///
    /// A key is a capability for its stored response: whoever presents it, in its
    /// scope, gets the response replayed. With the usual `fmt` subscriber every event
    /// in the request's span prints the span's fields, so a key in clear there ends up
    /// in every log line of the request. Turn hashing off (`false`) only where logs are
    /// as private as the responses, and keys carry no meaning of their own. The scope is
    /// always hashed. Events (warnings, errors) never carry the key themselves.
    #[must_use]
    pub fn hash_keys_in_traces(mut self, hash: bool) -> Self {
        self.config().hash_keys_in_traces = hash;
        self
    }

    /// How long the handler's response body may take to end once its head is ready
    /// (default 30 s; from 1 ms to 10 years). A guarded response is read whole before it
    /// is sent, so that it can be stored: a body that streams without end (server-sent
    /// events, say) or stalls would hold its key, and renew its lease, for as long as it
    /// lasts, even with its client gone. Past the bound it is treated as a response
    /// over [`response_body_limit`](Self::response_body_limit): what was read and the
    /// rest go to the client, and, if the storage policy would have stored it, the key
    /// is completed with a `response-not-stored` problem. Guard no streaming route.
    #[must_use]
    pub fn response_body_timeout(mut self, timeout: Duration) -> Self {
        self.config().response_body_timeout = settings::duration(timeout, MILLISECOND);
        self
    }

    /// The largest response body stored (default 1 MiB; at most 512 MiB, as PostgreSQL
    /// stores no value over 1 GB). A larger response still goes in full to its client;
    /// if the storage policy would have stored it, the key is completed with a
    /// `response-not-stored` problem, so a retry never runs the handler a second time
    /// (one the policy releases, a 5xx say, releases the key as always).
    #[must_use]
    pub fn response_body_limit(mut self, bytes: usize) -> Self {
        self.config().response_body_limit = bytes.min(LARGEST_STORED_BODY);
        self
    }

    /// How long to wait for the store on a claim before answering 503 (default 5 s; from
    /// 1 ms to 10 years). It also bounds the first attempt to store a response (its
    /// lease renewed meanwhile), after which the client gets its answer and the
    /// attempts go on in the background. In transactional mode it bounds every
    /// statement the layer sends in the transaction (a duplicate's claim waits on the
    /// row for `lock_timeout` more): a `COMMIT` with no answer in time is checked on
    /// another connection, a `ROLLBACK` with none closes its connection
    /// ([`transactional`](crate::transactional)).
    #[must_use]
    pub fn store_timeout(mut self, timeout: Duration) -> Self {
        self.config().store_timeout = settings::duration(timeout, MILLISECOND);
        self
    }

    /// Computes the scope of a request that carries no [`Principal`] (default: `auth:`
    /// and a hash of its `Authorization` header, [`Scope::from_authorization`], or the
    /// anonymous scope without one).
    ///
    /// A [`Principal`] inserted by the app's authentication comes first, and is the
    /// way to scope by account: this function is for apps that compute the scope from
    /// the request's parts themselves. Derive it from what the app has authenticated,
    /// never from a header the client sets unchecked: a client that can name any scope
    /// can read another's replays by guessing its keys.
    ///
    /// Setting it keeps the layer from warning that it scopes by the `Authorization`
    /// hash: `scope_with(Scope::from_authorization)` keeps that scope on purpose, for
    /// credentials that never change (API keys). It still warns, once, when the
    /// function gives the anonymous scope to a request that carries credentials
    /// ([`credential_headers`](Self::credential_headers)).
    ///
    /// ```
    /// use tower_idempotency::{IdempotencyLayer, Scope, store::MemoryStore};
    ///
    /// // One scope per tenant, named by the gateway in front, which checked the caller
    /// // (and drops the header from what clients send).
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).scope_with(|parts| {
    ///     match parts.headers.get("x-verified-tenant").and_then(|v| v.to_str().ok()) {
    ///         Some(tenant) => Scope::new(format!("tenant:{tenant}")),
    ///         None => Scope::from_authorization(parts),
    ///     }
    /// });
    /// ```
    #[must_use]
    pub fn scope_with(mut self, scope: impl Fn(&Parts) -> Scope + Send + Sync + 'static) -> Self {
        self.config().scoping.custom = Some(Arc::new(scope));
        self
    }

    /// Whether a guarded request without a [`Principal`] is refused (default `false`:
    /// it is scoped by [`scope_with`](Self::scope_with), or the fallbacks).
    ///
    /// With `true`, a request with a key on a guarded method that reaches the layer
    /// without a principal gets `500 misconfigured`, logged at `error` with its route:
    /// the handler does not run, nothing is claimed or stored. That is what a layer
    /// placed outside the app's authentication sees (in axum, an authentication
    /// `.layer` added *before* the idempotency layer), and what a route the
    /// authentication lets through unauthenticated sees: turn it on where every guarded
    /// route is authenticated, so that a wiring mistake is an error at the first
    /// request, not keys shared in one scope.
    ///
    /// ```
    /// use tower_idempotency::{IdempotencyLayer, store::MemoryStore};
    ///
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).require_principal(true);
    /// ```
    #[must_use]
    pub fn require_principal(mut self, required: bool) -> Self {
        self.config().scoping.require_principal = required;
        self
    }

    /// The request headers that carry credentials the layer does not scope by
    /// (default `Cookie` and `X-Api-Key`): a guarded request that carries one, and no
    /// [`Principal`], put in the anonymous scope, makes the layer warn, once, at `warn`,
    /// naming the route and the header. The list replaces the default: name `Cookie`
    /// and `X-Api-Key` too to keep them.
    ///
    /// ```
    /// use http::{HeaderName, header::COOKIE};
    /// use tower_idempotency::{IdempotencyLayer, store::MemoryStore};
    ///
    /// let layer = IdempotencyLayer::new(MemoryStore::new())
    ///     .credential_headers([COOKIE, HeaderName::from_static("x-session-token")]);
    /// ```
    #[must_use]
    pub fn credential_headers(mut self, headers: impl IntoIterator<Item = HeaderName>) -> Self {
        self.config().scoping.credential_headers = headers.into_iter().collect();
        self
    }

    /// The scope this layer computed before a deploy changed how it computes scopes
    /// (default none): while the keys stored under it live, a request whose key is new
    /// in its own scope is also looked for there, and is not run again if it ran.
    ///
    /// For a deploy that starts scoping by [`Principal`] where the layer hashed
    /// `Authorization` (its default before), pass [`Scope::from_authorization`]. A
    /// request whose claim takes a key new in its scope then looks the key up under the
    /// scope this function gives it, when that differs (one primary-key read, on the
    /// transaction's connection in transactional mode; with
    /// [`encrypt_responses`](Self::encrypt_responses) while clear records are accepted,
    /// the key is looked for as it is stored now and in clear, in both scopes: up to
    /// three reads, the first record found answering):
    ///
    /// - completed there by the same request (its fingerprint): its response is
    ///   replayed (opened, if it was sealed: one that does not open is
    ///   `500 response-unreadable`), and the new claim released;
    /// - there for a different request: `422 key-reused`; still running there:
    ///   `409 in-progress` (in both cases the new claim is released);
    /// - nothing there (or a record past its TTL, or a lapsed lease of the same
    ///   request, which a takeover would run again): the handler runs, under the new
    ///   scope;
    /// - the store fails to answer: `503 store-unavailable`, and nothing runs.
    ///
    /// It costs nothing when it is not set, and nothing for a request whose claim finds
    /// its key in its own scope (a replay, a `409`, a `422`). Keep it for one TTL (24 h
    /// by default) after the deploy, then remove it: no key of the old scope is left.
    ///
    /// What it cannot cover: a retry sent with another credential than the first
    /// attempt's (the old scope was that credential's; the old layer could not find it
    /// either); with old and new processes side by side during a rolling deploy, a
    /// request the *old* process runs after the new one looked (both run), a retry the
    /// old process gets of a request the new one ran (it looks only in the old scope),
    /// and in transactional mode a request still uncommitted in an old process (the
    /// read sees committed rows only). Drain the old processes before the new ones take
    /// traffic where that matters. The keys a handler derives
    /// ([`IdempotencyKey::derive`](crate::IdempotencyKey::derive)) follow the scope: a
    /// request whose first attempt was released (a `5xx`) before the deploy derives new
    /// ones after it.
    ///
    /// ```
    /// use tower_idempotency::{IdempotencyLayer, Scope, store::MemoryStore};
    ///
    /// // Principals from this deploy on; keys of the old Authorization scope honoured.
    /// let layer = IdempotencyLayer::new(MemoryStore::new())
    ///     .require_principal(true)
    ///     .previous_scope_with(Scope::from_authorization);
    /// ```
    #[must_use]
    pub fn previous_scope_with(
        mut self,
        scope: impl Fn(&Parts) -> Scope + Send + Sync + 'static,
    ) -> Self {
        self.config().scoping.previous = Some(Arc::new(scope));
        self
    }

    /// The request headers included in the fingerprint (default `Content-Type`). The list
    /// replaces the default: name `Content-Type` too to keep it. The
    /// [`fingerprint_scheme`](Self::fingerprint_scheme) set is kept; a function set with
    /// [`fingerprint_with`](Self::fingerprint_with) is replaced.
    #[must_use]
    pub fn fingerprint_headers(mut self, headers: impl IntoIterator<Item = HeaderName>) -> Self {
        let scheme = match &self.config().fingerprinter {
            Fingerprinter::Sha256 { scheme, .. } => *scheme,
            Fingerprinter::Custom(_) => FingerprintScheme::default(),
        };
        self.config().fingerprinter = Fingerprinter::Sha256 {
            headers: headers.into_iter().collect(),
            scheme,
        };
        self
    }

    /// How a request's body and `Content-Type` count in its fingerprint (default
    /// [`FingerprintScheme::Json`]: a JSON body as any JSON reader sees it, so that a
    /// client that re-serialises its JSON for a retry gets the replay, not a `422`;
    /// [`FingerprintScheme::Bytes`]: byte for byte). Records stored under the bytes
    /// scheme (by an earlier version, or before this setting changed to `Json`) keep
    /// matching their retries: each record is compared the way it was made. The
    /// headers set with [`fingerprint_headers`](Self::fingerprint_headers) are kept; a
    /// function set with [`fingerprint_with`](Self::fingerprint_with) is replaced.
    ///
    /// ```
    /// use tower_idempotency::{FingerprintScheme, IdempotencyLayer, store::MemoryStore};
    ///
    /// // Byte-exact fingerprints, as before the JSON scheme.
    /// let layer = IdempotencyLayer::new(MemoryStore::new())
    ///     .fingerprint_scheme(FingerprintScheme::Bytes);
    /// # let _ = layer;
    /// ```
    #[must_use]
    pub fn fingerprint_scheme(mut self, scheme: FingerprintScheme) -> Self {
        let headers = match &self.config().fingerprinter {
            Fingerprinter::Sha256 { headers, .. } => headers.clone(),
            Fingerprinter::Custom(_) => Arc::from([http::header::CONTENT_TYPE]),
        };
        self.config().fingerprinter = Fingerprinter::Sha256 { headers, scheme };
        self
    }

    /// Replaces the fingerprint with a function of the app's own.
    #[must_use]
    pub fn fingerprint_with(
        mut self,
        f: impl Fn(&Parts, &Bytes) -> Fingerprint + Send + Sync + 'static,
    ) -> Self {
        self.config().fingerprinter = Fingerprinter::Custom(Arc::new(f));
        self
    }

    /// Which responses are stored for replay (default
    /// [`default_storage_policy`](crate::default_storage_policy)); the others release
    /// the key so that a retry runs again.
    #[must_use]
    pub fn store_response_if(
        mut self,
        policy: impl Fn(StatusCode, &HeaderMap) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.config().policy = Arc::new(policy);
        self
    }

    /// Response headers never stored, so never replayed (default `Set-Cookie`: a session
    /// cookie belongs to the response that created it, not to every retry).
    ///
    /// The list replaces the default: name `Set-Cookie` too, or cookies are stored and
    /// handed to whoever retries with the key.
    ///
    /// ```
    /// use http::{HeaderName, header::SET_COOKIE};
    /// use tower_idempotency::{IdempotencyLayer, store::MemoryStore};
    ///
    /// let layer = IdempotencyLayer::new(MemoryStore::new())
    ///     .unreplayed_headers([SET_COOKIE, HeaderName::from_static("x-request-id")]);
    /// ```
    ///
    /// For a rule rather than a list, see
    /// [`unreplayed_headers_with`](Self::unreplayed_headers_with).
    #[must_use]
    pub fn unreplayed_headers(mut self, headers: impl IntoIterator<Item = HeaderName>) -> Self {
        let names: Vec<HeaderName> = headers.into_iter().collect();
        self.config().unreplayed_headers = Arc::new(move |headers: &mut HeaderMap| {
            for name in &names {
                headers.remove(name);
            }
        });
        self
    }

    /// Removes headers before a response is stored, so that they are never replayed:
    /// `remove` gets the headers the layer would store (the response's end-to-end
    /// headers; hop-by-hop ones are never stored) and takes out what it will not have
    /// stored, and kept in the table, and handed to whoever retries with the key. It
    /// replaces the default, which removes `Set-Cookie` (a session cookie belongs to the
    /// response that created it, not to every retry): remove it too, unless the app
    /// means to replay cookies. The response its first client gets is untouched.
    ///
    /// ```
    /// use http::header::SET_COOKIE;
    /// use tower_idempotency::{IdempotencyLayer, store::MemoryStore};
    ///
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).unreplayed_headers_with(|headers| {
    ///     headers.remove(SET_COOKIE);
    ///     // Whatever names a secret: a token handed out once, a signed download URL.
    ///     let secret: Vec<_> = headers
    ///         .keys()
    ///         .filter(|name| name.as_str().starts_with("x-secret-"))
    ///         .cloned()
    ///         .collect();
    ///     for name in secret {
    ///         headers.remove(name);
    ///     }
    /// });
    /// ```
    #[must_use]
    pub fn unreplayed_headers_with(
        mut self,
        remove: impl Fn(&mut HeaderMap) + Send + Sync + 'static,
    ) -> Self {
        self.config().unreplayed_headers = Arc::new(remove);
        self
    }

    /// Whether a stored response keeps its body (default `true`). With `false`, the
    /// table holds the status and the stored headers alone: a retry gets the original
    /// status, its headers (`Location` among them, which says where the result is)
    /// and an empty body, with `Idempotent-Replayed: true`; the headers that describe
    /// a body (`Content-Type`, `Content-Encoding`, digests…) are not stored either.
    /// For handlers whose responses say where their result lives (`201 Created` with
    /// `Location`), and whose bodies hold what the table should not (personal data,
    /// card details). The first client gets the whole response. The problems the layer
    /// stores itself (`response-not-stored`, `transaction-ended`) keep theirs.
    ///
    /// ```
    /// use tower_idempotency::{IdempotencyLayer, store::MemoryStore};
    ///
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).store_response_bodies(false);
    /// ```
    #[must_use]
    pub fn store_response_bodies(mut self, stored: bool) -> Self {
        self.config().store_bodies = stored;
        self
    }

    /// Seals every response the layer stores with `keys`, and stores idempotency keys
    /// hashed (see [`encryption`](crate::encryption)): a dump of the table holds no
    /// response and no live key. The status stays in clear; headers and body are sealed
    /// with XChaCha20-Poly1305 under the newest key, bound to the record's scope, key
    /// and status, so that a record copied onto another key answers
    /// `500 response-unreadable` rather than replay. Records stored before, in clear,
    /// still replay (see [`EncryptionKeys::accept_clear_records`](crate::encryption::EncryptionKeys::accept_clear_records)).
    /// Give every replica that serves the table the same keys.
    ///
    /// Costs a few microseconds per completion and per replay (docs/benchmarks.md),
    /// 53 bytes per record (the envelope), and a `key` of 66 bytes (its hash).
    ///
    /// ```
    /// use tower_idempotency::{IdempotencyLayer, encryption::EncryptionKeys, store::MemoryStore};
    ///
    /// # fn secret(_: &str) -> [u8; 32] { [7; 32] }
    /// let keys = EncryptionKeys::new(1, secret("idempotency-key-1"))
    ///     .with_key(2, secret("idempotency-key-2"))
    ///     .expect("two ids");
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).encrypt_responses(keys);
    /// ```
    #[must_use]
    pub fn encrypt_responses(mut self, keys: crate::encryption::EncryptionKeys) -> Self {
        self.config().sealing = crate::run::sealing::Sealing::new(keys);
        self
    }

    /// The base URI of the problem types in the layer's rejections (default
    /// [`DEFAULT_TYPE_BASE`](crate::rejection::DEFAULT_TYPE_BASE), this crate's
    /// documentation): each `type` is the problem's stable
    /// [slug](crate::rejection::Problem::slug) appended to it, so end it with `/` or `#`.
    /// For an API that documents its errors on a page of its own.
    ///
    /// ```
    /// use tower_idempotency::{IdempotencyLayer, store::MemoryStore};
    ///
    /// // `409` answers `"type": "https://api.example.com/problems/in-progress"`.
    /// let layer = IdempotencyLayer::new(MemoryStore::new())
    ///     .problem_type_base("https://api.example.com/problems/");
    /// ```
    #[must_use]
    pub fn problem_type_base(mut self, base: impl Into<Arc<str>>) -> Self {
        let problems = (*self.config.problems).clone().with_base(base.into());
        self.config().problems = Arc::new(problems);
        self
    }

    /// Answers the layer's rejections in the app's own error format: `render` gets each
    /// [`Rejection`] (its [`Problem`](crate::rejection::Problem), status, detail and
    /// `Retry-After`) and returns the whole response in its place. That covers every
    /// answer the layer gives instead of the handler's (`400` for a malformed key,
    /// `409` in progress, `422` key reused, `503`s, …), the problems it stores when a
    /// response cannot be (`500 response-not-stored`), and the extractors' rejections
    /// on the requests it guards. Replays of stored responses are the handler's own and
    /// pass untouched.
    ///
    /// Keep what a client relies on: the status, `Retry-After` where the rejection has
    /// one, and `Cache-Control: no-store`. For an app whose errors are axum responses
    /// (`IntoResponse`), [`rejection_into_response`](Self::rejection_into_response)
    /// takes its error type as it is.
    ///
    /// ```
    /// use http::{Response, header};
    /// use tower_idempotency::{IdempotencyLayer, store::MemoryStore};
    ///
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).rejection_with(|rejection| {
    ///     let mut res = Response::builder()
    ///         .status(rejection.status())
    ///         .header(header::CONTENT_TYPE, "application/json")
    ///         .header(header::CACHE_CONTROL, "no-store");
    ///     if let Some(after) = rejection.retry_after() {
    ///         res = res.header(header::RETRY_AFTER, after.as_secs().max(1));
    ///     }
    ///     let body = serde_json::json!({
    ///         "error": { "code": rejection.problem().slug(), "message": rejection.detail() }
    ///     });
    ///     res.body(body.to_string()).unwrap()
    /// });
    /// ```
    #[must_use]
    pub fn rejection_with<T>(
        mut self,
        render: impl Fn(&Rejection) -> http::Response<T> + Send + Sync + 'static,
    ) -> Self
    where
        T: Into<Bytes>,
    {
        let hook = Arc::new(move |rejection: &Rejection| Some(render(rejection).map(Into::into)));
        let problems = (*self.config.problems).clone().with_hook(hook);
        self.config().problems = Arc::new(problems);
        self
    }

    /// Answers the layer's rejections with the app's own error type, as
    /// [`rejection_with`](Self::rejection_with) does, for `render` returning anything
    /// that is an axum response ([`IntoResponse`](axum_core::response::IntoResponse)):
    /// the error type the app's handlers already answer with, its `Json` bodies, its
    /// status and header tuples.
    ///
    /// The layer stores some rejections (`response-not-stored`), so it reads the body
    /// `render` makes whole, at once: a body of bytes, a string or JSON is, up to 64 KiB.
    /// One that is not ready at once (a stream) or larger is answered with the default
    /// problem document instead, logged at `error`.
    ///
    /// ```
    /// use axum::{Json, http::{StatusCode, header}, response::{IntoResponse, Response}};
    /// use tower_idempotency::{IdempotencyLayer, rejection::Rejection, store::MemoryStore};
    ///
    /// /// The app's error type, which its handlers return.
    /// enum AppError {
    ///     Idempotency(Rejection),
    ///     // ... the app's other errors
    /// }
    ///
    /// impl IntoResponse for AppError {
    ///     fn into_response(self) -> Response {
    ///         let AppError::Idempotency(rejection) = self;
    ///         let body = Json(serde_json::json!({
    ///             "error": { "code": rejection.problem().slug(), "message": rejection.detail() }
    ///         }));
    ///         let mut res = (rejection.status(), [(header::CACHE_CONTROL, "no-store")], body)
    ///             .into_response();
    ///         if let Some(after) = rejection.retry_after() {
    ///             res.headers_mut().insert(header::RETRY_AFTER, after.as_secs().max(1).into());
    ///         }
    ///         res
    ///     }
    /// }
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// # use tower::ServiceExt;
    /// let layer = IdempotencyLayer::new(MemoryStore::new())
    ///     .rejection_into_response(|rejection| AppError::Idempotency(rejection.clone()));
    ///
    /// let app = axum::Router::new()
    ///     .route("/payments", axum::routing::post(|| async { "charged" }))
    ///     .layer(layer);
    /// let bad_key = axum::http::Request::post("/payments")
    ///     .header("idempotency-key", "not a valid key")
    ///     .body(axum::body::Body::empty())
    ///     .unwrap();
    /// let res = app.oneshot(bad_key).await.unwrap();
    /// assert_eq!(res.status(), StatusCode::BAD_REQUEST);
    /// let body = axum::body::to_bytes(res.into_body(), 1024).await.unwrap();
    /// let error: serde_json::Value = serde_json::from_slice(&body).unwrap();
    /// assert_eq!(error["error"]["code"], "key-malformed");
    /// # }
    /// ```
    #[cfg(feature = "axum")]
    #[must_use]
    pub fn rejection_into_response<R>(
        mut self,
        render: impl Fn(&Rejection) -> R + Send + Sync + 'static,
    ) -> Self
    where
        R: axum_core::response::IntoResponse,
    {
        let hook = Arc::new(move |rejection: &Rejection| {
            crate::rejection::rendered(rejection, render(rejection).into_response())
        });
        let problems = (*self.config.problems).clone().with_hook(hook);
        self.config().problems = Arc::new(problems);
        self
    }
}

impl IdempotencyLayer {
    /// The handle that shuts this layer down gracefully: every service built from this
    /// layer (and its clones) stops claiming and reports its in-flight requests to it.
    pub fn shutdown_handle(&self) -> ShutdownHandle {
        self.config.shutdown.clone()
    }

    /// Makes `handle` this layer's shutdown handle (default: one of its own). Give the
    /// same handle to every layer and job runner of the app, and one
    /// [`drain`](ShutdownHandle::drain) shuts them all down; build it with
    /// [`ShutdownHandle::closed_by`] to close it with the app's own
    /// `CancellationToken`. See [`ShutdownHandle`].
    #[must_use]
    pub fn shutdown_with(mut self, handle: ShutdownHandle) -> Self {
        self.config().shutdown = handle;
        self
    }

    /// Sets up the layer's store so that it can serve
    /// ([`Store::migrate`](crate::store::Store::migrate)): for PostgreSQL, creates the
    /// table and applies pending migrations
    /// ([`PostgresStore::migrate`](crate::store::PostgresStore::migrate), safe from
    /// every replica at start-up); for the memory store, nothing. Run it once before
    /// serving; a layer built from a bare pool needs no store object for it.
    ///
    /// ```no_run
    /// use tower_idempotency::{IdempotencyLayer, store::pool_for_url};
    ///
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// let pool = pool_for_url("postgres://postgres@127.0.0.1/postgres", 16)?;
    /// let layer = IdempotencyLayer::new(pool);
    /// layer.migrate().await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// The store could not be reached, or could not be set up (a migration that could
    /// not lock its table in time, a role that may not create the table).
    pub async fn migrate(&self) -> Result<(), crate::store::StoreError> {
        self.config.store.migrate().await
    }
}

impl IdempotencyLayer {
    /// Registers the layer's route as resumable under `name`: with each claim in lease
    /// mode, the request its handler needs is stored beside the key (method, URI, the
    /// `headers` named here, the body, and the client's key; sealed if the layer has
    /// [`encrypt_responses`](Self::encrypt_responses) keys), so that, should this
    /// process die while the handler runs, a live process's completer
    /// ([`spawn_completer`](Self::spawn_completer)) finishes it, even if the client
    /// never retries: it takes the key over, runs the handler with the stored request
    /// (its recorded [steps](crate::IdempotencyKey::step) replayed), and stores the
    /// response, which a later retry gets.
    ///
    /// One more statement per claimed request. What the app's own middleware puts in a
    /// request (a [`Principal`](crate::Principal)) is not stored: the completed run
    /// keeps the key's scope, and its handler finds no principal. Name only headers
    /// the handler needs; never a credential. Off by default. A key is finished only
    /// once its holder is known gone ([`PostgresStore`](crate::store::PostgresStore)
    /// with liveness); in transactional mode a crash rolls back, and nothing is left
    /// to finish.
    ///
    /// ```
    /// use axum::{Router, http::header, routing::post};
    /// use tower_idempotency::{IdempotencyKey, IdempotencyLayer};
    /// # use tower_idempotency::store::MemoryStore;
    ///
    /// async fn pay(key: IdempotencyKey) -> String {
    ///     format!("paid under {key}")
    /// }
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let layer = IdempotencyLayer::new(MemoryStore::new())
    ///     .resumable("payments", [header::CONTENT_TYPE]);
    /// // The route's handler, without the layer: what the completer runs.
    /// let completer = layer.spawn_completer(post(pay));
    /// let app: Router = Router::new().route("/payments", post(pay).route_layer(layer));
    /// # completer.abort();
    /// # }
    /// ```
    #[must_use]
    pub fn resumable(mut self, name: &str, headers: impl IntoIterator<Item = HeaderName>) -> Self {
        self.config().resumable = Some(crate::run::completer::Resumable {
            name: name.into(),
            headers: headers.into_iter().collect(),
        });
        self
    }

    /// Spawns the completer of the name this layer is registered
    /// [`resumable`](Self::resumable) under: every half second it asks the store for
    /// keys of that name whose holder is known gone (a process dead, by the liveness of
    /// [`PostgresStore`](crate::store::PostgresStore): never a live holder's, nor one
    /// whose lease merely lapsed), and runs each with `inner`, the route's handler
    /// without the layer, as the layer would have run it. Every replica may run one:
    /// one of them takes each key. It stops when the layer's
    /// [`shutdown_handle`](Self::shutdown_handle) closes, or when the handle is
    /// aborted. Needs a Tokio runtime.
    pub fn spawn_completer<S, ResBody>(&self, inner: S) -> tokio::task::JoinHandle<()>
    where
        S: tower_service::Service<
                http::Request<http_body_util::Full<bytes::Bytes>>,
                Response = http::Response<ResBody>,
            > + Clone
            + Send
            + 'static,
        S::Future: Send + 'static,
        S::Error: Send + 'static,
        ResBody: http_body::Body<Data = bytes::Bytes> + Send + 'static,
        ResBody::Error: Into<crate::BoxError>,
    {
        tokio::spawn(crate::run::completer::run(self.config.clone(), inner))
    }
}

impl<S> Layer<S> for IdempotencyLayer {
    type Service = Idempotency<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Idempotency {
            inner,
            config: self.config.clone(),
        }
    }
}

impl std::fmt::Debug for IdempotencyLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let c = &self.config;
        f.debug_struct("IdempotencyLayer")
            .field("methods", &c.methods)
            .field("require_key", &c.require_key)
            .field("header", &c.header)
            .field("lease", &c.lease)
            .field("ttl", &c.ttl)
            .field("request_body_limit", &c.request_body_limit)
            .field("response_body_limit", &c.response_body_limit)
            .field("response_body_timeout", &c.response_body_timeout)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemoryStore;

    #[test]
    fn a_stored_response_limit_stays_within_what_postgres_can_store() {
        let layer = IdempotencyLayer::new(MemoryStore::new()).response_body_limit(usize::MAX);
        assert_eq!(layer.config.response_body_limit, LARGEST_STORED_BODY);
        let layer = layer.response_body_limit(10);
        assert_eq!(layer.config.response_body_limit, 10);
    }
}
