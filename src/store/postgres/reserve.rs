//! Connections for the statements of running claims, which must not wait behind the
//! pool.
//!
//! A running claim's renewals, its completion and its release keep a handler from
//! running twice: a renewal that waits for a connection while long handlers (or the
//! app's own checkouts, or transactional requests) hold the whole pool fails at its
//! bound, the lease lapses, and a retry takes the key over and runs the handler again.
//! So these statements do not queue for a pooled connection. They take an idle one if
//! the pool has one, without waiting (the usual case, at the usual cost); otherwise
//! they go over the store's reserve: `RESERVE` connections made by the pool's manager
//! outside its `max_size`, kept, and shared by every such statement, which
//! tokio-postgres pipelines, each its own autocommit statement. The reserve is dealt
//! as shared claim connections are (`shared`): a connection that closes, or leaves a
//! statement unanswered for `shared::STALLED`, is replaced on its next use, with at
//! most `2 * RESERVE` open at once; past that, or with `slots::MAX_QUEUED` statements
//! on each, the statement waits for the pool as before.
//!
//! The pool's hooks (a `post_create` that runs `SET ROLE`, say) do not run on them:
//! deadpool keeps its hooks to itself, and runs them only on connections it makes for
//! the pool, which it does only below its `max_size`, when the reserve is not needed.
//! A connection kept ahead from the pool would have them, but could not be replaced
//! while the pool is exhausted, which is when it serves. So the store is given the
//! same set-up (`PostgresStore::with_session_setup`) and runs it on each reserve
//! connection it opens; and before a reserve connection serves, it is checked
//! (`Setup::open`): its role must be allowed to read and write the table. One that
//! is not (the app gave the pool a hook and not the store) is closed, the reserve is
//! refused for good, with an error in the log that says why, and the statement waits
//! for the pool, failing with that error if none comes: never a statement that fails
//! for want of privilege while a lease runs out.
//!
//! Claims, a duplicate's registration to wait, purges, migrations and transactional
//! mode's own transactions do not use the reserve: none of them is holding a key that
//! a retry could take. Transactional mode's statements from outside a transaction
//! that ended under the layer, or that work kept past the response, do (ending that
//! transaction on the server, finishing its key): the claim row may be committed
//! `running` by then, or held by a row lock that only they can let go.

use std::sync::{Arc, OnceLock};

use deadpool_postgres::{ClientWrapper, Pool};

use super::{
    Checkout, PostgresStore,
    checkout::POOL_WAIT,
    errors::{classify, lost_its_connection},
    shared::{STALLED, SharedClient},
};
use crate::store::{BoxFuture, StoreError, StoreErrorKind};

/// What the app runs on each connection the store makes outside its pool for running
/// claims (`PostgresStore::with_session_setup`): what its pool's `post_create` hook
/// runs on the pool's.
pub(super) type SessionSetup = Arc<
    dyn for<'c> Fn(&'c tokio_postgres::Client) -> BoxFuture<'c, Result<(), tokio_postgres::Error>>
        + Send
        + Sync,
>;

/// How reserve connections are opened: made by the pool's manager, set up as the app
/// says, and checked before they serve.
pub(super) struct Setup {
    session: Option<SessionSetup>,
    /// `Sql::reserve_check`: the connection's role, and whether it may do what
    /// running claims do to the table.
    check: String,
    /// Why the reserve was refused, once a connection failed the check or the
    /// database refused the setup: every connection after it would be made, and set
    /// up, the same way.
    refused: OnceLock<String>,
}

impl std::fmt::Debug for Setup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Setup")
            .field("session", &self.session.is_some())
            .field("refused", &self.refused.get())
            .finish_non_exhaustive()
    }
}

impl Setup {
    /// Reserve connections set up with `session`, checked with `check`
    /// (`Sql::reserve_check`).
    pub(super) fn new(session: Option<SessionSetup>, check: String) -> Self {
        Self {
            session,
            check,
            refused: OnceLock::new(),
        }
    }

    /// The app's setup, to build the store again with another setting.
    pub(super) fn session(&self) -> Option<SessionSetup> {
        self.session.clone()
    }

    /// A new reserve connection: made by `pool`'s manager, as the pool makes its own
    /// but outside it (however many pooled connections are checked out), set up with
    /// the app's `session`, then checked. A connection whose role may not read and
    /// write the table, or whose setup the database refuses, is closed, and refuses
    /// the reserve (`Misconfigured`) from then on; the first refusal is logged as an
    /// error. A connection lost or timed out on the way is only that connection's
    /// failure.
    pub(super) async fn open(&self, pool: &Pool) -> Result<ClientWrapper, StoreError> {
        if let Some(why) = self.refused.get() {
            return Err(StoreError::new(StoreErrorKind::Misconfigured, why.clone()));
        }
        let client = made(pool).await?;
        if let Some(session) = &self.session
            && let Err(e) = session(&client).await
        {
            let e = classify(e);
            if matches!(
                e.kind(),
                StoreErrorKind::Unavailable | StoreErrorKind::Timeout
            ) {
                return Err(e);
            }
            return Err(self.refuse(format!(
                "the store's session setup (PostgresStore::with_session_setup) failed on a \
                 reserve connection: {e}; until it succeeds, running claims wait for the pool"
            )));
        }
        let rows = client
            .query_typed(&self.check, &[])
            .await
            .map_err(classify)?;
        let role: String = rows.first().map(|r| r.get(0)).unwrap_or_default();
        if rows.first().is_some_and(|r| r.get::<_, bool>(1)) {
            return Ok(client);
        }
        Err(self.refuse(format!(
            "a reserve connection runs as role {role:?}, which may not read and write the \
             idempotency table: the pool's connections are set up by its hooks (a \
             post_create hook that runs SET ROLE, say), which do not run on connections \
             made outside the pool. Give the store the same setup with \
             PostgresStore::with_session_setup (docs/postgres.md, \"A pool whose hooks set \
             its sessions up\"); until then, running claims wait for the pool"
        )))
    }

    /// Refuses the reserve for `why`, from now on; logged as an error the first time.
    fn refuse(&self, why: String) -> StoreError {
        if self.refused.set(why.clone()).is_ok() {
            tracing::error!("{why}");
        }
        StoreError::new(StoreErrorKind::Misconfigured, why)
    }
}

/// A new connection made by `pool`'s manager, as the pool makes its own, but outside
/// it: however many pooled connections are checked out. Bounded by the pool's create
/// timeout, or `POOL_WAIT` if it sets none. Its statement cache is detached from the
/// manager's, as those of connections taken out of the pool are.
async fn made(pool: &Pool) -> Result<ClientWrapper, StoreError> {
    use deadpool::managed::Manager as _;
    let bound = pool.timeouts().create.unwrap_or(POOL_WAIT);
    let mut client = match tokio::time::timeout(bound, pool.manager().create()).await {
        Ok(made) => made.map_err(classify)?,
        Err(_) => {
            return Err(StoreError::new(
                StoreErrorKind::Timeout,
                "a reserve connection did not open within the pool's create timeout",
            ));
        }
    };
    pool.manager().detach(&mut client);
    Ok(client)
}

/// The reserve's connections (slots; each may be replaced once while its old
/// connection finishes its statements, so up to twice as many are open).
pub(super) const RESERVE: usize = 2;

/// A connection for a statement of a running claim: an idle pooled one, or one of the
/// reserve.
// Held for one statement, inside its future: boxing the pooled variant would cost an
// allocation on the usual path, to save stack on the rare one.
#[allow(clippy::large_enum_variant)]
pub(super) enum RunningClient<'a> {
    Pooled(Checkout),
    Reserve(SharedClient<'a>),
}

impl std::ops::Deref for RunningClient<'_> {
    type Target = ClientWrapper;

    fn deref(&self) -> &ClientWrapper {
        match self {
            Self::Pooled(client) => client,
            Self::Reserve(client) => client,
        }
    }
}

impl RunningClient<'_> {
    /// Awaits `statement`, sent on this connection. A reserve connection that leaves it
    /// unanswered for `STALLED` is forgotten, so that the next statements do not queue
    /// behind it; this one waits on (its caller bounds it).
    pub(super) async fn answer<T>(
        &self,
        statement: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let Self::Reserve(client) = self else {
            return statement.await;
        };
        let mut statement = std::pin::pin!(statement);
        match tokio::time::timeout(STALLED, statement.as_mut()).await {
            Ok(answered) => answered,
            Err(_) => {
                client.evict();
                statement.await
            }
        }
    }

    /// The statement was answered with `answer`: the connection goes back to the pool,
    /// or stays in the reserve unless the answer is that it was lost.
    pub(super) fn done<T>(self, answer: &Result<T, StoreError>) {
        match self {
            Self::Pooled(client) => client.done(),
            Self::Reserve(mut client) => {
                if matches!(answer, Err(e) if lost_its_connection(e)) {
                    client.evict();
                }
                client.answered();
            }
        }
    }
}

impl PostgresStore {
    /// A connection for a statement of a running claim (its renewal, completion or
    /// release): an idle pooled one, else one of the reserve, else, if the reserve is
    /// full or cannot open, a pooled one waited for as usual.
    ///
    /// A reserve refused because its connections may not write the table
    /// (`Setup::open`) is the error returned if the pool then gives no connection:
    /// the cause, where the pool's timeout would hide it.
    pub(super) async fn running_client(&self) -> Result<RunningClient<'_>, StoreError> {
        if let Some(client) = self.client_at_once().await? {
            return Ok(RunningClient::Pooled(client));
        }
        let refused = match self.reserve.get(&self.pool).await {
            Ok(Some(client)) => return Ok(RunningClient::Reserve(client)),
            Ok(None) => None,
            Err(e) if e.kind() == StoreErrorKind::Misconfigured => Some(e),
            Err(e) => {
                tracing::debug!(error = %e, "a reserve connection could not be opened; waiting for the pool");
                None
            }
        };
        match self.client().await {
            Ok(client) => Ok(RunningClient::Pooled(client)),
            Err(e) => Err(refused.unwrap_or(e)),
        }
    }
}
