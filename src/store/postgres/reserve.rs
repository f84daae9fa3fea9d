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
//! Claims, a duplicate's registration to wait, purges, migrations and transactional
//! mode's own transactions do not use the reserve: none of them is holding a key that
//! a retry could take. Transactional mode's statements from outside a transaction
//! that ended under the layer, or that work kept past the response, do (ending that
//! transaction on the server, finishing its key): the claim row may be committed
//! `running` by then, or held by a row lock that only they can let go.

use deadpool_postgres::ClientWrapper;

use super::{
    Checkout, PostgresStore,
    errors::lost_its_connection,
    shared::{STALLED, SharedClient},
};
use crate::store::StoreError;

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
    pub(super) async fn running_client(&self) -> Result<RunningClient<'_>, StoreError> {
        if let Some(client) = self.client_at_once().await? {
            return Ok(RunningClient::Pooled(client));
        }
        match self.reserve.get(&self.pool).await {
            Ok(Some(client)) => return Ok(RunningClient::Reserve(client)),
            Ok(None) => {}
            Err(e) => {
                tracing::debug!(error = %e, "a reserve connection could not be opened; waiting for the pool");
            }
        }
        self.client().await.map(RunningClient::Pooled)
    }
}
