//! Liveness: the keys of a holder whose process is gone taken over in a second, not
//! after their lease; never a live holder's (`PostgresStore::with_liveness`).
//!
//! Each store (its clones share it) is a holder with a random id. Its lease-mode claims
//! name it (`holder`), and it holds a session-level advisory lock of that id on a
//! connection of its own, made with the notification connection's configuration (a
//! direct one, never a transaction pooler's). Once the lock is held, that connection
//! registers the holder in `<table>_holders`, an unlogged table, with this server's
//! start time. While the store runs claims, it renews the holder's `seen_at` there every
//! `HEARTBEAT`, on another connection, made by the pool's manager (not on that one).
//! Both run the app's session setup (`PostgresStore::with_session_setup`) first, as
//! the reserve's connections do: they write a table, as the pool's connections do
//! once its hooks have set them up.
//!
//! A duplicate that finds a running claim with a live lease takes it over (next token,
//! as after a lapsed lease) only when its holder is gone (migration 0004's function, in
//! the claim and again in the takeover, which is one token-checked `UPDATE`):
//!
//! - the claim is older than `GRACE`;
//! - the holder is registered on this server since its last start: its row exists (a
//!   crash restart empties the unlogged table; a promoted standby never had its rows)
//!   and names this server's start (a clean restart keeps the rows);
//! - its `seen_at` is older than `GRACE`;
//! - and its lock is free, tried with `pg_try_advisory_xact_lock`, held until the
//!   takeover commits.
//!
//! Why a live holder is never taken over. Its lock is held by a session of its own
//! until the server ends that session: a stalled runtime, a slow network, a pooler in
//! front of the pool change nothing there (the connection is direct, and the session
//! is set never to time out; in a partition the server ends it only after the
//! kernel's TCP keepalive, hours, long after the lease has done its work). When the
//! server does end it while the process lives, either every lock went (a restart, a
//! crash, a failover), and then the holder's row no longer counts until it registers
//! again, which it does only once it holds its lock again; or its session alone went
//! (cut, terminated), and then it still renews `seen_at` on its other connection while
//! it reconnects. A holder that cannot renew `seen_at` for `GRACE` while its lock is free
//! (cut off from the database entirely, its sessions ended on the server, or stalled
//! just then) cannot be told from a dead one: docs/postgres.md says so.

use std::{
    sync::{
        Arc, Mutex, PoisonError, Weak,
        atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering},
    },
    task::Poll,
    time::Duration,
};

use deadpool_postgres::{ClientWrapper, Pool};
use tokio::time::Instant;

use super::{
    checkout::POOL_WAIT,
    errors::{Shown, classify},
    hosts::Hosts,
    reserve::SessionSetup,
    sql::Statement,
    tls::Connector,
};
use crate::store::{StoreError, StoreErrorKind};

/// How long a holder must have been silent, its lock free, before its claims are
/// taken over; and how long after its claim a claim is never taken over so.
pub(super) const GRACE: Duration = Duration::from_secs(1);

/// How often a holder running claims renews its `seen_at`: four times within `GRACE`,
/// so that one renewal late or lost does not make it look silent.
const HEARTBEAT: Duration = Duration::from_millis(250);

/// How long the liveness connection may take to connect.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// The longest wait between two attempts to connect.
const MAX_BACKOFF: Duration = Duration::from_secs(1);

/// The liveness connection's session settings: nothing of the server's or the role's
/// ends it while it idles (its statement waits for its own lock as long as it takes),
/// and the server's TCP keepalive and user timeout are the kernel's own (hours), not a
/// shorter one of the server's configuration, which would end it, and free its lock,
/// in a partition shorter than the lease. Only the settings this server has are set.
const SETTINGS: &str = "SELECT set_config(name, '0', false) FROM pg_settings
     WHERE name IN ('statement_timeout', 'lock_timeout', 'idle_in_transaction_session_timeout',
                    'idle_session_timeout', 'transaction_timeout', 'tcp_keepalives_idle',
                    'tcp_keepalives_interval', 'tcp_keepalives_count', 'tcp_user_timeout')";

/// One store's liveness: its holder id, its liveness connection, and its heartbeat.
pub(super) struct Liveness {
    holder: i64,
    hosts: Arc<Hosts>,
    connector: Connector,
    register: Statement,
    forget: Statement,
    /// The heartbeat, a simple query (the id is the store's own number), and the
    /// pool whose manager makes its connection.
    heartbeat: String,
    pool: Pool,
    /// What the app runs on each connection the store makes outside its pool
    /// (`with_session_setup`): on the liveness connection and the heartbeat's.
    session_setup: Option<SessionSetup>,
    /// Why the liveness connection last failed to hold its lock and register, until
    /// it does: what `start_liveness` says when it gives up.
    failed: Mutex<Option<StoreError>>,
    /// Whether a heartbeat's failure that a retry will not mend (a right missing, say)
    /// was logged as a warning since the last heartbeat that went through.
    warned: AtomicBool,
    /// The heartbeat's connection, made by the pool's manager outside the pool (its
    /// configuration, its TLS, through the same pooler if any), kept between bursts
    /// of claims: the heartbeat neither waits for the pool, which the handlers may
    /// hold entirely, nor depends on the liveness connection, which it stands in for
    /// while that one reconnects.
    beat_on: Mutex<Option<ClientWrapper>>,
    /// The task that holds the lock, and whether it runs (read by every claim, so
    /// without the lock).
    started: Mutex<Option<tokio::task::AbortHandle>>,
    holding: AtomicBool,
    /// Whether the lock is held and the holder registered.
    held: tokio::sync::watch::Sender<bool>,
    /// Claims acquired and not yet completed or released.
    running: AtomicUsize,
    /// Until when the heartbeat goes on (ms from `epoch`): a lease after the last
    /// claim or renewal, so that a claim its owner forgot ends it all the same.
    active_until: AtomicU64,
    epoch: Instant,
    /// Whether a heartbeat task runs.
    beating: AtomicBool,
    pub(super) heartbeats: AtomicU64,
    pub(super) takeovers: AtomicU64,
}

impl Drop for Liveness {
    fn drop(&mut self) {
        if let Some(task) = self
            .started
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
        {
            task.abort();
        }
    }
}

impl Liveness {
    pub(super) fn new(
        config: &tokio_postgres::Config,
        connector: Connector,
        pool: Pool,
        session_setup: Option<SessionSetup>,
        sql: &super::sql::Sql,
    ) -> Self {
        // Positive and never 0, like a fencing token: any 63-bit number would do.
        let holder = ((crate::random::u64() >> 1) as i64).max(1);
        Self {
            holder,
            hosts: Arc::new(Hosts::new(config)),
            connector,
            register: sql.register_holder.clone(),
            forget: sql.forget_holders.clone(),
            heartbeat: format!(
                "UPDATE {} SET seen_at = now() WHERE holder = {holder}",
                sql.holders
            ),
            pool,
            session_setup,
            failed: Mutex::new(None),
            warned: AtomicBool::new(false),
            beat_on: Mutex::new(None),
            started: Mutex::new(None),
            holding: AtomicBool::new(false),
            held: tokio::sync::watch::channel(false).0,
            running: AtomicUsize::new(0),
            active_until: AtomicU64::new(0),
            epoch: Instant::now(),
            beating: AtomicBool::new(false),
            heartbeats: AtomicU64::new(0),
            takeovers: AtomicU64::new(0),
        }
    }

    /// The holder id the store's lease-mode claims carry.
    pub(super) fn holder(&self) -> i64 {
        self.holder
    }

    pub(super) fn is_held(&self) -> bool {
        *self.held.borrow()
    }

    /// Starts the task that holds the lock, if it is not running (needs a runtime; it
    /// runs on the one that first calls this, and again on the next if that one ended).
    pub(super) fn start(self: &Arc<Self>) {
        if self.holding.load(Ordering::Acquire) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let mut started = self.started.lock().unwrap_or_else(PoisonError::into_inner);
        if !self.holding.load(Ordering::Acquire) {
            self.holding.store(true, Ordering::Release);
            let task = runtime.spawn(hold(Arc::downgrade(self)));
            *started = Some(task.abort_handle());
        }
    }

    /// Starts the task and waits until the lock is held and the holder registered, at
    /// most `bound`; else why the liveness connection last failed, if it did.
    pub(super) async fn held_within(
        self: &Arc<Self>,
        bound: Duration,
    ) -> Result<(), Option<StoreError>> {
        self.start();
        let mut rx = self.held.subscribe();
        let held = tokio::time::timeout(bound, rx.wait_for(|held| *held))
            .await
            .is_ok_and(|r| r.is_ok());
        if held {
            return Ok(());
        }
        Err(self
            .failed
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .map(StoreError::copied))
    }

    /// The liveness connection failed with `e` (`None`: it holds its lock now).
    fn failed(&self, e: Option<StoreError>) {
        *self.failed.lock().unwrap_or_else(PoisonError::into_inner) = e;
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// The heartbeat goes on until `lease` from now at least.
    fn extend(&self, lease: Duration) {
        let until = self
            .now_ms()
            .saturating_add(u64::try_from(lease.as_millis()).unwrap_or(u64::MAX));
        self.active_until.fetch_max(until, Ordering::AcqRel);
    }

    /// Whether the holder runs claims, as far as it knows.
    fn active(&self) -> bool {
        self.running.load(Ordering::Acquire) > 0
            && self.now_ms() < self.active_until.load(Ordering::Acquire)
    }

    /// A claim of `lease` was acquired: the heartbeat runs while it does.
    pub(super) fn acquired(self: &Arc<Self>, lease: Duration) {
        self.running.fetch_add(1, Ordering::AcqRel);
        self.extend(lease);
        self.beat();
    }

    /// A claim was renewed for `lease`.
    pub(super) fn renewed(self: &Arc<Self>, lease: Duration) {
        self.extend(lease);
        self.beat();
    }

    /// A claim was completed or released (or found lost).
    pub(super) fn ended(&self) {
        let _ = self
            .running
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
    }

    /// Starts the heartbeat task unless one runs.
    fn beat(self: &Arc<Self>) {
        if self.beating.load(Ordering::Acquire) || self.beating.swap(true, Ordering::AcqRel) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            self.beating.store(false, Ordering::Release);
            return;
        };
        runtime.spawn(heartbeat(self.clone()));
    }

    /// Renews `seen_at` once, on the heartbeat's connection (made first if need be,
    /// set up as the app says, and dropped if the renewal fails, to be made again next
    /// time).
    async fn renew_seen_at(&self) -> Result<(), StoreError> {
        let held = self
            .beat_on
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        let client = match held {
            Some(client) if !client.is_closed() => client,
            _ => {
                use deadpool::managed::Manager as _;
                let bound = self.pool.timeouts().create.unwrap_or(POOL_WAIT);
                let made = tokio::time::timeout(bound, self.pool.manager().create()).await;
                let mut client = made
                    .map_err(|_| {
                        StoreError::new(
                            StoreErrorKind::Timeout,
                            "no connection within the pool's create timeout",
                        )
                    })?
                    .map_err(classify)?;
                self.pool.manager().detach(&mut client);
                if let Some(setup) = &self.session_setup {
                    setup(&client).await.map_err(classify)?;
                }
                client
            }
        };
        client
            .batch_execute(&self.heartbeat)
            .await
            .map_err(classify)?;
        *self.beat_on.lock().unwrap_or_else(PoisonError::into_inner) = Some(client);
        Ok(())
    }
}

/// Renews the holder's `seen_at` every `HEARTBEAT` while the store runs claims. The
/// first renewal comes a `HEARTBEAT` after the claim that started it (the claim's own
/// time stands for it until `GRACE`): a store whose handlers take less never renews.
/// Each renewal is bounded by `GRACE`; one that takes longer is dropped with its
/// connection.
async fn heartbeat(liveness: Arc<Liveness>) {
    loop {
        tokio::time::sleep(HEARTBEAT).await;
        if !liveness.active() {
            liveness.beating.store(false, Ordering::Release);
            // A claim that came in between, and found the task still beating, did not
            // start another: this one goes on for it.
            if !liveness.active() || liveness.beating.swap(true, Ordering::AcqRel) {
                return;
            }
        }
        match tokio::time::timeout(GRACE, liveness.renew_seen_at()).await {
            Ok(Ok(())) => {
                liveness.heartbeats.fetch_add(1, Ordering::Relaxed);
                liveness.warned.store(false, Ordering::Relaxed);
            }
            // One that a retry will not mend (a right missing, the table not migrated,
            // the app's session setup refused) is said once, loudly.
            Ok(Err(e))
                if e.kind() == StoreErrorKind::Misconfigured
                    && !liveness.warned.swap(true, Ordering::Relaxed) =>
            {
                tracing::warn!(error = %e, "a liveness heartbeat failed");
            }
            Ok(Err(e)) => tracing::debug!(error = %e, "a liveness heartbeat failed"),
            Err(_) => tracing::debug!("a liveness heartbeat went unanswered"),
        }
    }
}

/// Held by the task that holds the lock: however it ends (its runtime shut down, say),
/// the holder stops counting as held, and the next claim starts the task again.
struct Released(Weak<Liveness>);

impl Drop for Released {
    fn drop(&mut self) {
        if let Some(me) = self.0.upgrade() {
            me.held.send_replace(false);
            me.holding.store(false, Ordering::Release);
        }
    }
}

/// Holds the holder's lock on a connection of its own, for as long as the store
/// lives: connects, takes the lock (waiting for it while an earlier session of this
/// holder still has it on the server), registers, and waits for the connection to end;
/// then connects again, at once the first time.
async fn hold(me: Weak<Liveness>) {
    let _released = Released(me.clone());
    let mut backoff = Duration::ZERO;
    loop {
        if !backoff.is_zero() {
            tokio::time::sleep(backoff).await;
        }
        let Some(liveness) = me.upgrade() else { return };
        let (hosts, connector) = (liveness.hosts.clone(), liveness.connector.clone());
        let (holder, register, forget, setup) = (
            liveness.holder,
            liveness.register.clone(),
            liveness.forget.clone(),
            liveness.session_setup.clone(),
        );
        // Not kept across the wait: the store may go meanwhile.
        drop(liveness);
        let connected = tokio::time::timeout(CONNECT_TIMEOUT, connector.connect(&hosts)).await;
        let (client, mut connection) = match connected {
            Ok(Ok(connected)) => connected,
            Ok(Err(e)) => {
                tracing::warn!(error = %Shown(&e), "the idempotency liveness connection cannot connect");
                if let Some(me) = me.upgrade() {
                    me.failed(Some(classify(e)));
                }
                backoff = (backoff * 2).clamp(Duration::from_millis(50), MAX_BACKOFF);
                continue;
            }
            Err(_) => {
                let why = format!(
                    "the idempotency liveness connection cannot connect: no connection within {} s",
                    CONNECT_TIMEOUT.as_secs()
                );
                tracing::warn!("{why}");
                if let Some(me) = me.upgrade() {
                    me.failed(Some(StoreError::new(StoreErrorKind::Timeout, why)));
                }
                backoff = (backoff * 2).clamp(Duration::from_millis(50), MAX_BACKOFF);
                continue;
            }
        };
        let mut session = Box::pin(async {
            // The app's setup first: its settings may not end the session (`SETTINGS`).
            if let Some(setup) = &setup {
                setup(&client).await?;
            }
            client.batch_execute(SETTINGS).await?;
            client
                .execute("SELECT pg_advisory_lock($1)", &[&holder])
                .await?;
            client.execute(&*register, &[&holder]).await?;
            // Best effort: holders long gone are forgotten by the next registration.
            if let Err(e) = client.execute(&*forget, &[&holder]).await {
                tracing::debug!(error = %Shown(&e), "could not forget holders long gone");
            }
            Ok::<(), tokio_postgres::Error>(())
        });
        let mut registered = false;
        let ended = std::future::poll_fn(|cx| {
            if !registered && let Poll::Ready(done) = session.as_mut().poll(cx) {
                if let Err(e) = done {
                    return Poll::Ready(Some(e));
                }
                registered = true;
                if let Some(me) = me.upgrade() {
                    me.failed(None);
                    me.held.send_replace(true);
                }
            }
            loop {
                match connection.poll_message(cx) {
                    Poll::Ready(Some(Ok(_))) => {}
                    Poll::Ready(Some(Err(e))) => return Poll::Ready(Some(e)),
                    Poll::Ready(None) => return Poll::Ready(None),
                    Poll::Pending => return Poll::Pending,
                }
            }
        })
        .await;
        let Some(liveness) = me.upgrade() else { return };
        liveness.held.send_replace(false);
        let error = ended.as_ref().map_or_else(
            || "closed by the server".to_owned(),
            |e| Shown(e).to_string(),
        );
        if registered {
            drop(liveness);
            tracing::warn!(%error, "the idempotency liveness connection was lost; reconnecting");
            backoff = Duration::ZERO;
        } else {
            // Classified, with what to do where the cause is likely (the table not
            // migrated, a right missing), for `start_liveness` to say.
            liveness.failed(Some(ended.map_or_else(
                || StoreError::new(StoreErrorKind::Unavailable, "closed by the server"),
                classify,
            )));
            drop(liveness);
            tracing::warn!(%error, "the idempotency liveness connection could not hold its lock");
            backoff = (backoff * 2).clamp(Duration::from_millis(50), MAX_BACKOFF);
        }
    }
}
