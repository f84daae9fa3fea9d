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
    sync::{Arc, Mutex, PoisonError, Weak},
    task::Poll,
    time::Duration,
};

use deadpool_postgres::{ClientWrapper, Pool};

pub(super) use super::holder::GRACE;
use super::{
    checkout::POOL_WAIT,
    errors::{Shown, classify},
    holder::{
        Activity, Beat, CONNECT_TIMEOUT, Hold, Holding, SETTINGS, backoff_after,
        heartbeat_statement, new_holder_id,
    },
    hosts::Hosts,
    reserve::SessionSetup,
    sql::Statement,
    tls::Connector,
};
use crate::store::{BoxFuture, StoreError, StoreErrorKind};

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
    /// The heartbeat's connection, made by the pool's manager outside the pool (its
    /// configuration, its TLS, through the same pooler if any), kept between bursts
    /// of claims: the heartbeat neither waits for the pool, which the handlers may
    /// hold entirely, nor depends on the liveness connection, which it stands in for
    /// while that one reconnects.
    beat_on: Mutex<Option<ClientWrapper>>,
    /// The task that holds the lock: whether it runs, whether the lock is held.
    pub(super) holding: Holding,
    /// Whether it runs claims (its heartbeat's schedule), and what it counts.
    pub(super) activity: Activity,
}

impl Liveness {
    pub(super) fn new(
        config: &tokio_postgres::Config,
        connector: Connector,
        pool: Pool,
        session_setup: Option<SessionSetup>,
        sql: &super::sql::Sql,
    ) -> Self {
        let holder = new_holder_id();
        Self {
            holder,
            hosts: Arc::new(Hosts::new(config)),
            connector,
            register: sql.register_holder.clone(),
            forget: sql.forget_holders.clone(),
            heartbeat: heartbeat_statement(&sql.holders, holder),
            pool,
            session_setup,
            beat_on: Mutex::new(None),
            holding: Holding::default(),
            activity: Activity::default(),
        }
    }

    /// The holder id the store's lease-mode claims carry.
    pub(super) fn holder(&self) -> i64 {
        self.holder
    }

    /// Starts the task that holds the lock, if it is not running (needs a runtime; it
    /// runs on the one that first calls this, and again on the next if that one ended).
    pub(super) fn start(self: &Arc<Self>) {
        super::holder::start(self);
    }

    /// A claim of `lease` was acquired: the heartbeat runs while it does.
    pub(super) fn acquired(self: &Arc<Self>, lease: Duration) {
        super::holder::acquired(self, lease);
    }

    /// A claim was renewed for `lease`.
    pub(super) fn renewed(self: &Arc<Self>, lease: Duration) {
        super::holder::renewed(self, lease);
    }

    /// A claim was completed or released (or found lost).
    pub(super) fn ended(&self) {
        self.activity.ended();
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

impl Beat for Liveness {
    fn activity(&self) -> &Activity {
        &self.activity
    }

    fn renew_seen_at(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(Liveness::renew_seen_at(self))
    }
}

impl Hold for Liveness {
    fn holding(&self) -> &Holding {
        &self.holding
    }

    fn hold(me: Weak<Self>) -> BoxFuture<'static, ()> {
        Box::pin(hold(me))
    }
}

/// Holds the holder's lock on a connection of its own, for as long as the store
/// lives: connects, takes the lock (waiting for it while an earlier session of this
/// holder still has it on the server), registers, and waits for the connection to end;
/// then connects again, at once the first time.
async fn hold(me: Weak<Liveness>) {
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
                    me.holding.failed(classify(e));
                }
                backoff = backoff_after(backoff);
                continue;
            }
            Err(_) => {
                let why = format!(
                    "the idempotency liveness connection cannot connect: no connection within {} s",
                    CONNECT_TIMEOUT.as_secs()
                );
                tracing::warn!("{why}");
                if let Some(me) = me.upgrade() {
                    me.holding
                        .failed(StoreError::new(StoreErrorKind::Timeout, why));
                }
                backoff = backoff_after(backoff);
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
                    me.holding.held();
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
        liveness.holding.lost();
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
            liveness.holding.failed(ended.map_or_else(
                || StoreError::new(StoreErrorKind::Unavailable, "closed by the server"),
                classify,
            ));
            drop(liveness);
            tracing::warn!(%error, "the idempotency liveness connection could not hold its lock");
            backoff = backoff_after(backoff);
        }
    }
}
