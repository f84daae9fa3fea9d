//! Connections shared by concurrent statements, which tokio-postgres pipelines.
//!
//! A claim is one autocommit statement on the primary key, and for a key that exists
//! (a replay, a 409, a 422) a read. It needs no connection of its own: concurrent
//! claims are written to a shared connection back to back, each with its own `Sync`,
//! so each still commits (or fails) alone, and PostgreSQL reads and answers them in
//! batches instead of waking once per statement.
//!
//! What a shared connection must not do is let one claim hold up the others queued
//! behind it. Each runs with a short `lock_timeout`: a claim that would wait on a row
//! lock (held by a transactional claim, a purge, or the app's own transaction) fails
//! fast, having changed nothing, and the store runs it again on a pooled connection of
//! its own, where it may wait. A connection that closes is replaced on its next use.
//! Statements that always write (completions, releases, renewals) stay on pooled
//! connections, where their commits overlap.
//!
//! The same dealing serves the store's reserve ([`Opened::Reserve`], see `reserve`):
//! connections made outside the pool for the statements of running claims, when the
//! pool has no idle connection for them.
//!
//! Which connection a statement is dealt, and the counts that decide it, are
//! `slots`'s; this file opens the connections.

use std::{
    sync::atomic::{AtomicU64, Ordering},
    time::Duration,
};

use deadpool_postgres::{ClientWrapper, Object, Pool};

pub(super) use super::slots::SharedClient;
use super::{
    checkout::pooled,
    errors::classify,
    reserve::{SessionSetup, Setup},
    slots::Slots,
};
use crate::store::StoreError;

/// The `lock_timeout` of a shared connection: how long one claim may hold up the
/// claims queued behind it before it moves to a connection of its own.
const LOCK_TIMEOUT: Duration = Duration::from_millis(50);

/// How long a claim on a shared connection may go unanswered before its slot forgets
/// the connection. A claim takes milliseconds, and one that meets a row lock gives up
/// at `LOCK_TIMEOUT`; a connection silent for this long may have been dropped without
/// a word (by a NAT or a load balancer), and the next claims must not queue behind it.
/// The claims already sent on it keep it until they end.
pub(super) const STALLED: Duration = Duration::from_secs(1);

/// Where shared connections come from, and what they are set up for.
#[derive(Debug)]
pub(super) enum Opened {
    /// Claims: taken out of the pool for good (the pool may open others in their
    /// place), with a short `lock_timeout` (`LOCK_TIMEOUT`).
    ForClaims,
    /// The reserve: made by the pool's manager (its configuration, its TLS) outside the
    /// pool's `max_size`, so that they open while every pooled connection is checked
    /// out, set up as the app says and checked before they serve (`reserve::Setup`);
    /// with no session setting of the store's own.
    Reserve(Setup),
}

/// `n` connections, taken from the pool when first used and kept, and dealt to claims
/// as `slots` says: to the one with the fewest in flight, the first on a tie.
pub(super) struct Shared {
    opened: Opened,
    slots: Slots<ClientWrapper>,
    /// Statements dealt a shared connection and moved off it.
    moved: AtomicU64,
}

/// A connection for a slot, `opened` so. One for claims is taken out of the pool for
/// good: the pool may open another in its place, and this one, with its own
/// `lock_timeout`, never goes back to serve a transaction. One for the reserve is made
/// by the pool's manager, the pool never knowing of it (`Setup::open`).
async fn connect(pool: &Pool, opened: &Opened) -> Result<ClientWrapper, StoreError> {
    match opened {
        Opened::ForClaims => {
            let client = Object::take(pooled(pool).await?);
            let set = format!("SET lock_timeout = '{}ms'", LOCK_TIMEOUT.as_millis());
            client.batch_execute(&set).await.map_err(classify)?;
            Ok(client)
        }
        Opened::Reserve(setup) => setup.open(pool).await,
    }
}

impl Shared {
    /// `n` connections, `opened` so.
    pub(super) fn new(n: usize, opened: Opened) -> Self {
        Self {
            opened,
            slots: Slots::new(n),
            moved: AtomicU64::new(0),
        }
    }

    /// The connection with the fewest claims in flight (the first of them on a tie),
    /// opened (or reopened) from `pool` if need be; `None`, for a pooled connection
    /// instead (see `Slots::get`).
    pub(super) async fn get(&self, pool: &Pool) -> Result<Option<SharedClient<'_>>, StoreError> {
        self.slots.get(|| connect(pool, &self.opened)).await
    }

    /// The app's session setup of reserve connections, if it gave one.
    pub(super) fn session_setup(&self) -> Option<SessionSetup> {
        match &self.opened {
            Opened::ForClaims => None,
            Opened::Reserve(setup) => setup.session(),
        }
    }

    /// Forgets `client` after it lost its connection or stopped answering (`STALLED`):
    /// see [`SharedClient::evict`].
    pub(super) fn evict(&self, client: &SharedClient<'_>) {
        client.evict();
    }

    /// How many connections are shared.
    pub(super) fn len(&self) -> usize {
        self.slots.len()
    }

    /// Records a claim that met a row lock and moves to a pooled connection.
    pub(super) fn moved_off(&self) {
        self.moved.fetch_add(1, Ordering::Relaxed);
    }

    /// Statements dealt a shared connection.
    pub(super) fn dealt_count(&self) -> u64 {
        self.slots.dealt_count()
    }

    pub(super) fn moved(&self) -> u64 {
        self.moved.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use std::task::Poll;

    use super::*;

    /// A pool whose database accepts connections and never answers, as one frozen or
    /// cut off does, and gives each attempt `create` to connect.
    async fn unanswered_pool(create: Duration) -> Pool {
        let silent = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let port = silent.local_addr().expect("address").port();
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((socket, _)) = silent.accept().await {
                held.push(socket);
            }
        });
        let config: tokio_postgres::Config = format!("postgres://postgres@127.0.0.1:{port}/x")
            .parse()
            .expect("url");
        let manager = deadpool_postgres::Manager::new(config, tokio_postgres::NoTls);
        Pool::builder(manager)
            .runtime(deadpool_postgres::Runtime::Tokio1)
            .create_timeout(Some(create))
            .build()
            .expect("pool")
    }

    #[tokio::test]
    async fn claims_waiting_on_a_failed_connection_attempt_take_the_pool() {
        let pool = unanswered_pool(Duration::from_millis(200)).await;
        let shared = Shared::new(1, Opened::ForClaims);
        let get = || shared.get(&pool);
        let (a, b, c, d) = tokio::join!(get(), get(), get(), get());
        let claims = [a, b, c, d];
        // One claim tried to connect and failed; the others, which waited for it, did
        // not try again one after another.
        let failed = claims.iter().filter(|c| c.is_err()).count();
        let to_the_pool = claims.iter().filter(|c| matches!(c, Ok(None))).count();
        assert_eq!((failed, to_the_pool), (1, 3));
        assert_eq!(shared.slots.in_flight(), [0]);
        assert_eq!(
            shared.dealt_count(),
            0,
            "no claim was given a shared connection"
        );
    }

    #[tokio::test]
    async fn a_claim_cancelled_while_its_connection_opens_gives_its_counts_back() {
        let pool = unanswered_pool(Duration::from_secs(60)).await;
        let reserve = Opened::Reserve(Setup::new(None, "SELECT".into()));
        for (opened, how) in [(Opened::ForClaims, "claims"), (reserve, "reserve")] {
            let shared = Shared::new(1, opened);
            // Polled once (counted, then waiting for its new connection), dropped.
            let pending = {
                let mut get = std::pin::pin!(shared.get(&pool));
                std::future::poll_fn(|cx| Poll::Ready(get.as_mut().poll(cx).is_pending())).await
            };
            assert!(pending, "{how}: the claim did not wait for its connection");
            assert_eq!(shared.slots.open_count(), 0, "{how}");
            assert_eq!(shared.slots.in_flight(), [0], "{how}");
        }
    }
}
