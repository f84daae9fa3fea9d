//! Connections the store keeps out of the app's pool for its own statements
//! (`SqlxStore::with_kept_connections`).
//!
//! sqlx's pool tests every connection given back to it with a round trip (a `Sync`,
//! sent from a task of its own), and no option turns that off: each claim, completion
//! or replay through the pool costs PostgreSQL and the app a second exchange. A kept
//! connection goes back to the store's own idle list instead, untested: a statement
//! that ended with its answer read leaves it ready for the next.
//!
//! They are made by the pool (so the pool's `after_connect` hook has run on them) and
//! detached from it, so they are outside its `max_connections`: the pool can open
//! others in their place, and the app's `pool.close()` does not wait for them. They
//! are opened when a statement finds none idle, up to the number set. While all of
//! them are lent out, a statement takes an idle connection of the pool if it has one,
//! else waits for the first kept one given back: the store never makes the pool open
//! connections for it beyond the kept ones, which would only add sessions for
//! PostgreSQL to switch between. A kept connection is closed,
//! not kept, when its statement fails without the server's answer (a connection lost,
//! a timeout, a future dropped mid-statement), when it is left in a transaction, once it
//! is older than the pool's `max_lifetime`, and once the pool is closed. One idle for
//! longer than [`TEST_IDLE_AFTER`] is tested with a round trip before it serves again,
//! as the pool tests its own: a restart or a failover of the server ends its session
//! while it sits idle.

use std::{
    ops::{Deref, DerefMut},
    sync::{Arc, Mutex, PoisonError},
    time::{Duration, Instant},
};

use ::sqlx::{
    Connection as _, PgConnection, PgPool, Postgres, TransactionManager as _, pool::PoolConnection,
};
use sqlx::postgres::PgTransactionManager;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::classify;
use crate::store::StoreError;

/// The store's kept connections: those idle, and how many are open.
pub(super) struct Kept {
    pool: PgPool,
    most: usize,
    /// A permit for each kept connection lent out.
    lending: Arc<Semaphore>,
    state: Mutex<State>,
}

/// How long a kept connection may have been idle and still serve without a test: a
/// connection in steady use is never tested, one left idle through a restart or a
/// failover of the server is found closed before a statement is sent on it.
const TEST_IDLE_AFTER: Duration = Duration::from_secs(1);

struct Idle {
    conn: PgConnection,
    opened: Instant,
    since: Instant,
}

#[derive(Default)]
struct State {
    idle: Vec<Idle>,
    /// Idle and lent out.
    open: usize,
}

impl Kept {
    pub(super) fn new(pool: PgPool, most: usize) -> Arc<Self> {
        Arc::new(Self {
            pool,
            most,
            lending: Arc::new(Semaphore::new(most)),
            state: Mutex::new(State::default()),
        })
    }

    /// How many it may keep.
    pub(super) fn most(&self) -> usize {
        self.most
    }

    /// How many are open now, idle and lent out.
    pub(super) fn open(&self) -> usize {
        self.state().open
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A connection for one statement (or one transaction): a kept one at once if one
    /// is idle or fewer than `most` are open; while all `most` are lent out, an idle
    /// connection of the pool if it has one, else the first kept one given back. So
    /// the store's statements never make the pool open a connection for them beyond
    /// the kept ones. Once the pool is closed, the pool's answer (an error).
    async fn lend(self: &Arc<Self>) -> Result<Lent, StoreError> {
        if self.pool.is_closed() {
            self.close_idle();
            return Ok(Lent::Pooled(self.pool.acquire().await.map_err(classify)?));
        }
        let permit = match self.lending.clone().try_acquire_owned() {
            Ok(permit) => permit,
            Err(_) => {
                if let Some(pooled) = self.pool.try_acquire() {
                    return Ok(Lent::Pooled(pooled));
                }
                match self.lending.clone().acquire_owned().await {
                    Ok(permit) => permit,
                    Err(_) => unreachable!("the lending semaphore is never closed"),
                }
            }
        };
        let mut lent = self.take().await?;
        lent.permit = Some(permit);
        Ok(Lent::Kept(lent))
    }

    /// An idle kept connection, or a new one from the pool: the caller holds a permit,
    /// so fewer than `most` are lent out. One idle for longer than
    /// [`TEST_IDLE_AFTER`] is tested first, and closed if it fails the test.
    async fn take(self: &Arc<Self>) -> Result<KeptConn, StoreError> {
        loop {
            let idle = {
                let mut state = self.state();
                if state.idle.is_empty() {
                    state.open += 1;
                }
                state.idle.pop()
            };
            let Some(Idle {
                conn,
                opened,
                since,
            }) = idle
            else {
                break;
            };
            let mut lent = self.lent(conn, opened);
            if since.elapsed() < TEST_IDLE_AFTER {
                return Ok(lent);
            }
            let conn = lent.conn.as_mut().unwrap_or_else(|| unreachable!());
            if conn.ping().await.is_ok() {
                return Ok(lent);
            }
            // Dropped: closed, and the next one looked at.
        }
        // Counted open above: uncounted again if the pool gives none, or if this
        // future is dropped while it waits for one.
        let opening = Opening(self);
        let conn = self.pool.acquire().await.map_err(classify)?;
        std::mem::forget(opening);
        Ok(self.lent(conn.detach(), Instant::now()))
    }

    /// Closes the idle ones (the pool is closed).
    fn close_idle(&self) {
        let mut state = self.state();
        state.open -= state.idle.len();
        state.idle.clear();
    }

    fn lent(self: &Arc<Self>, conn: PgConnection, since: Instant) -> KeptConn {
        KeptConn {
            conn: Some(conn),
            since,
            kept: self.clone(),
            permit: None,
        }
    }
}

/// A kept connection being opened, counted open until it is.
struct Opening<'a>(&'a Kept);

impl Drop for Opening<'_> {
    fn drop(&mut self) {
        self.0.state().open -= 1;
    }
}

/// A kept connection lent to one statement (or one transaction): back to the idle
/// list by [`done`](Lent::done), closed if dropped.
pub(super) struct KeptConn {
    conn: Option<PgConnection>,
    since: Instant,
    kept: Arc<Kept>,
    /// One of the `most` lent out at once; let go after the connection is idle again
    /// (or closed), for the next statement waiting.
    permit: Option<OwnedSemaphorePermit>,
}

impl KeptConn {
    fn give_back(mut self) {
        let Some(conn) = self.conn.take() else {
            return;
        };
        let expired = self
            .kept
            .pool
            .options()
            .get_max_lifetime()
            .is_some_and(|most| self.since.elapsed() >= most);
        if expired
            || self.kept.pool.is_closed()
            || PgTransactionManager::get_transaction_depth(&conn) != 0
        {
            // Closed by the drop below.
            self.conn = Some(conn);
            return;
        }
        self.kept.state().idle.push(Idle {
            conn,
            opened: self.since,
            since: Instant::now(),
        });
    }
}

impl Drop for KeptConn {
    fn drop(&mut self) {
        if self.conn.take().is_some() {
            // The socket closes with it: the server ends the session, and with it any
            // transaction or statement it was running.
            self.kept.state().open -= 1;
        }
    }
}

/// A connection for the store's statements: one it keeps, or one of the pool's.
pub(crate) enum Lent {
    Kept(KeptConn),
    Pooled(PoolConnection<Postgres>),
}

impl Lent {
    /// A kept connection (see `Kept::lend`) if the store keeps any, else one of the
    /// pool's.
    pub(super) async fn from(kept: Option<&Arc<Kept>>, pool: &PgPool) -> Result<Self, StoreError> {
        match kept {
            Some(kept) => kept.lend().await,
            None => Ok(Self::Pooled(pool.acquire().await.map_err(classify)?)),
        }
    }

    /// Its statement is done, its answer read: a kept connection goes back to the idle
    /// list (unless it is left in a transaction, or past the pool's `max_lifetime`), a
    /// pooled one to the pool.
    pub(crate) fn done(self) {
        match self {
            Self::Kept(conn) => conn.give_back(),
            Self::Pooled(_) => {}
        }
    }

    /// Closed when dropped rather than handed to the next user: it may hold a
    /// transaction, or a statement whose answer never came. (A kept connection
    /// dropped before [`done`](Self::done) is always closed.)
    pub(crate) fn close_on_drop(&mut self) {
        if let Self::Pooled(conn) = self {
            conn.close_on_drop();
        }
    }
}

impl Deref for Lent {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        match self {
            Self::Kept(kept) => kept.conn.as_ref().unwrap_or_else(|| unreachable!()),
            Self::Pooled(conn) => conn,
        }
    }
}

impl DerefMut for Lent {
    fn deref_mut(&mut self) -> &mut PgConnection {
        match self {
            Self::Kept(kept) => kept.conn.as_mut().unwrap_or_else(|| unreachable!()),
            Self::Pooled(conn) => conn,
        }
    }
}

/// Whether a connection whose statement failed with `e` is ready for the next: the
/// server answered with an error of the statement, not one that ends the session
/// (classes 08, 57 and XX: the connection, an operator or a shutdown, the server's
/// own failure).
pub(super) fn leaves_it_ready(e: &::sqlx::Error) -> bool {
    let Some(db) = e.as_database_error() else {
        return false;
    };
    !db.code().is_some_and(|code| {
        ["08", "57", "XX"]
            .iter()
            .any(|class| code.starts_with(class))
    })
}
