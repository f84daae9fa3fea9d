//! The transaction API of transactional mode: `BEGIN` with the claim, the completion
//! with `COMMIT`, `ROLLBACK`, the check of a `COMMIT` in doubt, and, for a transaction
//! the layer gives up on, the statement that ends it on the server.
//!
//! Each function sends its statements and waits for their answers; bounding them in
//! time is the caller's part (`crate::transactional`), and so is closing a connection
//! given up on midway (dropping its `Checkout`).

use std::time::{Duration, SystemTime};

use deadpool_postgres::ClientWrapper;
use tokio_postgres::{SimpleQueryMessage, types::ToSql};

use super::{Checkout, PostgresStore, classify};
use crate::{
    Fingerprint, StoredResponse,
    store::{Claim, ClaimRequest, Lease, StoreError, StoreErrorKind},
};

/// The server session and the transaction a claim opened: what tells that transaction
/// apart from any other, on that backend or behind a pooler that lends it to others
/// once the transaction ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Backend {
    /// `pg_backend_pid()` inside the transaction.
    pid: i32,
    /// The transaction's start (`now()` in it): `xact_start` in `pg_stat_activity`
    /// while it runs, and `created_at` of the claim row it inserted or took over.
    started: SystemTime,
}

/// Statements of transactional mode (see `Sql`).
pub(super) struct Statements {
    /// Ends a transaction on the server from another session.
    end: String,
}

impl Statements {
    /// The statements, for any table.
    pub(super) fn new() -> Self {
        Self {
            // Only while that backend still runs that transaction: a backend whose
            // session ended may be another's now, and one behind a pooler serves
            // other clients once the transaction is over.
            end: "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
                  WHERE pid = $1 AND xact_start = $2"
                .to_owned(),
        }
    }
}

/// `BEGIN` (with `isolation`, e.g. `" ISOLATION LEVEL READ COMMITTED"`, or `""`) and
/// the transaction's `lock_timeout`, as one simple query that also returns the
/// backend's pid.
pub(crate) fn begin(isolation: &str, lock_timeout: Duration) -> String {
    format!(
        "BEGIN{isolation}; {}; SELECT pg_backend_pid()",
        set_lock_timeout(lock_timeout)
    )
}

/// `SET LOCAL lock_timeout`, in milliseconds (at least 1: zero would mean no bound).
fn set_lock_timeout(lock_timeout: Duration) -> String {
    format!(
        "SET LOCAL lock_timeout = {}",
        lock_timeout.as_millis().max(1)
    )
}

/// The pid a `begin` query returned.
fn backend_pid(messages: &[SimpleQueryMessage]) -> Result<i32, StoreError> {
    messages
        .iter()
        .find_map(|m| match m {
            SimpleQueryMessage::Row(row) => row.get(0),
            _ => None,
        })
        .and_then(|pid| pid.parse().ok())
        .ok_or_else(|| {
            StoreError::new(
                StoreErrorKind::Corrupt,
                "BEGIN returned no backend pid".to_owned(),
            )
        })
}

/// `ROLLBACK` on `conn`: back to the pool if the server answers it, closed (which
/// rolls back) if not, or if it takes longer than `bound`.
pub(crate) async fn rollback(conn: Checkout, bound: Duration) {
    match tokio::time::timeout(bound, conn.batch_execute("ROLLBACK")).await {
        Ok(Ok(())) => conn.done(),
        // Dropping the Checkout closes the connection, which rolls back.
        Ok(Err(e)) => tracing::warn!(error = %e, "rollback failed; closing the connection"),
        Err(_) => tracing::warn!("no answer to ROLLBACK in time; closing the connection"),
    }
}

/// `COMMIT` on `client`, as the driver answers it.
pub(crate) async fn commit_on(client: &ClientWrapper) -> Result<(), tokio_postgres::Error> {
    client.batch_execute("COMMIT").await
}

impl PostgresStore {
    /// Sends `begin` (see [`begin`]) and the claim together, one round trip: the claim
    /// with the database's `now()` and the pid of the backend that runs it.
    pub(crate) async fn begin_and_claim(
        &self,
        client: &ClientWrapper,
        begin: &str,
        request: &ClaimRequest<'_>,
        token: i64,
    ) -> Result<(Claim, Backend), StoreError> {
        let failed = |e| StoreError::new(StoreErrorKind::Unavailable, e);
        let (begun, claim) = tokio::join!(
            client.simple_query(begin),
            self.claim_at(client, request, token)
        );
        let pid = backend_pid(&begun.map_err(failed)?)?;
        let (claim, started) = claim?;
        Ok((claim, Backend { pid, started }))
    }

    /// `BEGIN ISOLATION LEVEL READ COMMITTED`, with `lock_timeout`.
    pub(crate) async fn begin_read_committed(
        &self,
        client: &ClientWrapper,
        lock_timeout: Duration,
    ) -> Result<(), StoreError> {
        let failed = |e| StoreError::new(StoreErrorKind::Unavailable, e);
        client
            .batch_execute(&begin(" ISOLATION LEVEL READ COMMITTED", lock_timeout))
            .await
            .map_err(failed)
    }

    /// Rolls back the transaction on `client` (to begin another), waiting for it.
    pub(crate) async fn roll_back_on(&self, client: &ClientWrapper) -> Result<(), StoreError> {
        let failed = |e| StoreError::new(StoreErrorKind::Unavailable, e);
        client.batch_execute("ROLLBACK").await.map_err(failed)
    }

    /// Sets the transaction's `lock_timeout` again.
    pub(crate) async fn set_lock_timeout_on(
        &self,
        client: &ClientWrapper,
        lock_timeout: Duration,
    ) -> Result<(), StoreError> {
        let failed = |e| StoreError::new(StoreErrorKind::Unavailable, e);
        client
            .batch_execute(&set_lock_timeout(lock_timeout))
            .await
            .map_err(failed)
    }

    /// Prepares the completion statement on `client` (a no-op once cached), so that its
    /// execution can be pipelined with a `COMMIT`.
    pub(crate) async fn prepare_completion(
        &self,
        client: &ClientWrapper,
    ) -> Result<(), StoreError> {
        client
            .prepare_cached(&self.sql.complete)
            .await
            .map(drop)
            .map_err(classify)
    }

    /// Whether the transaction that claimed `lease` for `fingerprint` and sent `sent` as
    /// its completion committed, once it has ended: for a `COMMIT` whose answer was lost.
    /// `client` is in a read committed transaction of its own, which the caller rolls
    /// back.
    ///
    /// The row then carries that claim's token, completed with that response, only if
    /// it committed. A duplicate's claim cannot be taken for it: a fresh claim's token is
    /// drawn at random, and the read sees the row as the transaction left it unless a
    /// duplicate that was waiting on it has taken it and committed in the moment since.
    /// Only a takeover of an expired row gets the same token (one more than the row's);
    /// that duplicate would also need the same input and the same stored response. The
    /// check relies on the record outliving it: a TTL of milliseconds, with a purge or a
    /// takeover in between, reads as not committed.
    pub(crate) async fn committed_on(
        &self,
        client: &ClientWrapper,
        lease: &Lease,
        fingerprint: &Fingerprint,
        sent: &StoredResponse,
    ) -> Result<bool, StoreError> {
        let (scope, key) = (lease.scope.as_str(), &*lease.key);
        let fp: &[u8] = fingerprint.as_bytes();
        self.query_on(client, &self.sql.in_doubt_wait, &[&scope, &key, &fp])
            .await?;
        let rows = self
            .query_on(client, &self.sql.in_doubt_read, &[&scope, &key])
            .await?;
        let Some(row) = rows.first() else {
            return Ok(false);
        };
        let ours = row.get::<_, i64>(0) == lease.token
            && row.get::<_, &str>(1) == "completed"
            && row.get::<_, &[u8]>(2) == fp
            && row.get::<_, Option<i16>>(3) == Some(sent.status.as_u16() as i16)
            && row.get::<_, Option<&[u8]>>(4)
                == Some(&StoredResponse::encode_headers(&sent.headers)[..])
            && row.get::<_, Option<&[u8]>>(5) == Some(&sent.body[..]);
        Ok(ours)
    }

    /// Ends the transaction `backend` runs, from a pooled connection: its session is
    /// terminated, which rolls the transaction back and lets its locks go. `Ok(false)`
    /// when that backend no longer runs that transaction.
    pub(crate) async fn end_transaction(&self, backend: &Backend) -> Result<bool, StoreError> {
        let client = self.client().await?;
        let params: [&(dyn ToSql + Sync); 2] = [&backend.pid, &backend.started];
        let ended = self.query_on(&client, &self.sql.tx.end, &params).await;
        client.done();
        Ok(ended?.first().is_some_and(|row| row.get::<_, bool>(0)))
    }
}
