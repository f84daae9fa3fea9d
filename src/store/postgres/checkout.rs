//! Connections and the statements run on them: a pooled connection that is closed, not
//! given back, when its work is abandoned midway ([`Checkout`]), and the one way every
//! statement is sent (prepared once per connection, or unnamed behind a pooler).

use std::{sync::atomic::Ordering, time::Duration};

use deadpool::managed::{TimeoutType, Timeouts};
use deadpool_postgres::{Client, ClientWrapper, Pool, PoolError};
use tokio_postgres::{Row, types::ToSql};

use super::{
    PostgresStore,
    errors::{again_if_it_lost_a_race, classify, classify_pool},
    sql::{self, Statement},
    tls::Connector,
};
use crate::store::{StoreError, StoreErrorKind};

/// How long a statement waits for a connection from a pool that sets no wait timeout.
pub(super) const POOL_WAIT: Duration = Duration::from_secs(5);

/// A connection from `pool`, waiting at most the pool's wait timeout, or `POOL_WAIT`
/// if it sets none (see `PostgresStore::client`).
pub(super) async fn pooled(pool: &Pool) -> Result<Client, StoreError> {
    if pool.timeouts().wait.is_some() {
        return pool.get().await.map_err(classify_pool);
    }
    match tokio::time::timeout(POOL_WAIT, pool.get()).await {
        Ok(got) => got.map_err(classify_pool),
        Err(_) => Err(StoreError::new(
            StoreErrorKind::Timeout,
            "no connection from the pool within 5 s (the pool sets no wait timeout)",
        )),
    }
}

/// How long a cancel request for an abandoned statement may take (see `Checkout`).
pub(super) const CANCEL_WAIT: Duration = Duration::from_secs(5);

/// A pooled connection that goes back to the pool only once its work is done
/// ([`done`](Self::done)). Dropped before that, it is closed instead, and what it may
/// still be running on the server cancelled: its caller gave up in the middle of a
/// statement (a timeout, a client gone), and a connection whose answer never came may
/// be dead without a word, its next user waiting behind that answer for as long as TCP
/// takes to give up; or a transaction was left open on it, which closing rolls back.
/// (Behind a transaction pooler, no cancel request is sent: `None`; see
/// `PostgresStore::with_transaction_pooling`.)
pub(crate) struct Checkout(pub(super) Option<Client>, pub(super) Option<Connector>);

impl Checkout {
    /// The work is done: the connection goes back to the pool.
    pub(crate) fn done(mut self) {
        drop(self.0.take());
    }
}

impl std::ops::Deref for Checkout {
    type Target = Client;

    fn deref(&self) -> &Client {
        match &self.0 {
            Some(conn) => conn,
            None => unreachable!("the connection leaves a Checkout only when it is done"),
        }
    }
}

impl Drop for Checkout {
    fn drop(&mut self) {
        if let Some(conn) = self.0.take() {
            // Out of the pool for good: it is closed, not handed to the next user.
            let conn = deadpool_postgres::Object::take(conn);
            // The server does not notice a closed connection while a statement waits
            // (on a lock, say): it is told to cancel it, or it would wait on, holding
            // a backend, for as long as the statement's own bound allows. Over the
            // store's TLS, if it has one (`PostgresStore::with_tls`). The connection is
            // closed once the cancel request has gone, not before: a PgBouncer (1.18)
            // that receives a cancel request for a client that has just gone can crash,
            // taking every client's connection with it.
            if let (Ok(runtime), Some(connector)) =
                (tokio::runtime::Handle::try_current(), self.1.take())
            {
                let cancel = conn.cancel_token();
                // Bounded: a server that stopped answering (a primary frozen or cut off
                // in a failover) would hold the request, and its socket, for ever.
                runtime.spawn(async move {
                    match tokio::time::timeout(CANCEL_WAIT, connector.cancel(cancel)).await {
                        Ok(Ok(())) => {}
                        Ok(Err(e)) => {
                            tracing::debug!(error = %e, "could not cancel an abandoned statement");
                        }
                        Err(_) => tracing::debug!(
                            "no answer to the cancel request of an abandoned statement"
                        ),
                    }
                    drop(conn);
                });
            }
        }
    }
}

impl PostgresStore {
    /// A pooled connection. A pool with no wait timeout of its own (deadpool's default)
    /// gets one of `POOL_WAIT`, as the pools of `pool_for_url` have: a claim whose caller
    /// gave up on it is finished in a task of its own, and under overload such tasks
    /// would otherwise queue for a connection without end, ahead of new requests.
    pub(crate) async fn client(&self) -> Result<Checkout, StoreError> {
        pooled(&self.pool).await.map(|conn| self.checkout(conn))
    }

    /// A pooled connection if one is idle, or can be opened, at once; `None` if the
    /// pool is at its size with every connection checked out.
    pub(super) async fn client_at_once(&self) -> Result<Option<Checkout>, StoreError> {
        let at_once = Timeouts {
            wait: Some(Duration::ZERO),
            ..self.pool.timeouts()
        };
        match self.pool.timeout_get(&at_once).await {
            Ok(conn) => Ok(Some(self.checkout(conn))),
            Err(PoolError::Timeout(TimeoutType::Wait)) => Ok(None),
            Err(e) => Err(classify_pool(e)),
        }
    }

    /// `conn`, checked out of the pool (see `Checkout`).
    pub(super) fn checkout(&self, conn: Client) -> Checkout {
        Checkout(Some(conn), self.canceller())
    }

    /// Runs `sql` on a pooled connection, again after a lost race, then gives the
    /// connection back (given up on midway, it is closed instead: `Checkout`).
    pub(super) async fn execute_pooled(
        &self,
        sql: &Statement,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<u64, StoreError> {
        let client = self.client().await?;
        let done = again_if_it_lost_a_race(|| self.execute_on(&client, sql, params)).await;
        client.done();
        done
    }

    /// [`execute_pooled`](Self::execute_pooled) for a statement that returns rows.
    pub(super) async fn query_pooled(
        &self,
        sql: &Statement,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<Row>, StoreError> {
        let client = self.client().await?;
        let rows = again_if_it_lost_a_race(|| self.query_on(&client, sql, params)).await;
        client.done();
        rows
    }

    /// How a connection given up on in the middle of a statement has it cancelled: over
    /// the store's TLS, and not at all behind a transaction pooler (see `Checkout`).
    pub(super) fn canceller(&self) -> Option<Connector> {
        (!self.transaction_pooling).then(|| self.connector.clone())
    }

    /// Runs `sql` on `client`: prepared once per connection, or, behind a transaction
    /// pooler ([`with_transaction_pooling`](Self::with_transaction_pooling)), unnamed,
    /// parsed in the same round trip as it runs.
    pub(super) async fn query_on(
        &self,
        client: &ClientWrapper,
        sql: &Statement,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<Row>, StoreError> {
        if self.transaction_pooling {
            self.statements.fetch_add(1, Ordering::Relaxed);
            let typed = sql::typed(sql, params);
            return client.query_typed(sql, &typed).await.map_err(classify);
        }
        let stmt = client.prepare_cached(sql).await.map_err(classify)?;
        self.statements.fetch_add(1, Ordering::Relaxed);
        client.query(&stmt, params).await.map_err(classify)
    }

    /// [`query_on`](Self::query_on) for a statement whose rows are not read: how many
    /// it changed.
    pub(super) async fn execute_on(
        &self,
        client: &ClientWrapper,
        sql: &Statement,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<u64, StoreError> {
        if self.transaction_pooling {
            self.statements.fetch_add(1, Ordering::Relaxed);
            let typed = sql::typed(sql, params);
            return client.execute_typed(sql, &typed).await.map_err(classify);
        }
        let stmt = client.prepare_cached(sql).await.map_err(classify)?;
        self.statements.fetch_add(1, Ordering::Relaxed);
        client.execute(&stmt, params).await.map_err(classify)
    }

    /// Prepares `sql` on `client` (a no-op once cached, and behind a transaction
    /// pooler), so that its execution can be pipelined behind another's.
    pub(super) async fn prepare_on(
        &self,
        client: &ClientWrapper,
        sql: &Statement,
    ) -> Result<(), StoreError> {
        if self.transaction_pooling {
            return Ok(());
        }
        client.prepare_cached(sql).await.map(drop).map_err(classify)
    }
}
