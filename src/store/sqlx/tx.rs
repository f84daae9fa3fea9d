//! Transactional mode on sqlx: the connection that holds a request's transaction
//! ([`SqlxConn`]), and the transaction API of `store/postgres/tx.rs` sent through sqlx.
//! The statements, the reading of their rows and the classification of their errors
//! are the PostgreSQL store's; this file owns the connections, the binding of
//! parameters and the conversion of types.
//!
//! The transaction is sqlx's own (begun through `PgTransactionManager`, as
//! `Connection::begin` does, with the claim's `BEGIN` statement): to sqlx the
//! connection is in a transaction, so the app's code that calls `begin()` on it gets a
//! `SAVEPOINT`, and its `commit()` releases it, rather than ending the layer's
//! transaction.
//!
//! sqlx does not pipeline: `BEGIN` and the claim go in two round trips, and the
//! completion and its `COMMIT` in two, where the tokio-postgres driver sends each pair
//! in one. Behind a transaction pooler, where a statement with parameters takes two
//! exchanges, the transaction is asked first whether it still holds its session
//! ([`SqlxStore::in_claim_transaction`]), and every statement outside it runs in a
//! transaction of its own.

use std::{
    ops::{Deref, DerefMut},
    sync::Arc,
    time::{Duration, SystemTime},
};

use ::sqlx::{
    Connection as _, Executor as _, PgConnection, Postgres, RawSql, TransactionManager as _,
    encode::{Encode, IsNull},
    error::BoxDynError,
    pool::PoolConnection,
    postgres::{
        PgArgumentBuffer, PgArguments, PgQueryResult, PgRow, PgTransactionManager, PgTypeInfo,
        types::Oid,
    },
    query::Query,
};

use super::{
    super::{
        claim::{CLAIM_ATTEMPTS, Found, found, ms},
        errors::{again_if_it_lost_a_race, lost_a_race},
        row::{Columns, need},
        sql::col,
        steps::{place, step},
        tx::{
            Backend, Ending, Resolution, begin, begin_claiming, ending, in_claim_transaction,
            resolution,
        },
    },
    SqlxRow, SqlxStore, classify,
    kept::Lent,
};
use crate::{
    Fingerprint, StoredResponse,
    store::{
        BoxFuture, Claim, ClaimRequest, Fenced, FencingToken, Lease, RecordedStep, StoreError,
        StoreErrorKind,
    },
};

/// A connection that holds a transaction of the layer's (one the store keeps, or one
/// of the app's pool): it goes back only once its work is done
/// ([`done`](Self::done)); dropped before that (a timeout, a request dropped, work
/// given up on), it is closed, which rolls back whatever transaction it holds.
pub(crate) struct SqlxConn {
    conn: Option<Lent>,
    /// Behind a transaction pooler, whether the claim's transaction was found still
    /// open once the handler had run ([`SqlxStore::in_claim_transaction`]), once asked.
    held: Option<bool>,
}

impl SqlxConn {
    /// The work is done: the connection goes back, unless sqlx still counts a
    /// transaction open on it (one the handler leaked): then it is closed.
    pub(crate) fn done(mut self) {
        if let Some(conn) = &self.conn
            && PgTransactionManager::get_transaction_depth(conn) == 0
            && let Some(conn) = self.conn.take()
        {
            conn.done();
        }
    }
}

impl Deref for SqlxConn {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        match &self.conn {
            Some(conn) => conn,
            None => unreachable!("the connection leaves a SqlxConn only when it is done"),
        }
    }
}

impl DerefMut for SqlxConn {
    fn deref_mut(&mut self) -> &mut PgConnection {
        match &mut self.conn {
            Some(conn) => conn,
            None => unreachable!("the connection leaves a SqlxConn only when it is done"),
        }
    }
}

impl Drop for SqlxConn {
    fn drop(&mut self) {
        if let Some(mut conn) = self.conn.take() {
            // Closed, not handed to the next user: it may hold a transaction, or a
            // statement whose answer never came.
            conn.close_on_drop();
        }
    }
}

/// A `timestamptz` parameter, sent in binary (sqlx encodes `SystemTime` only with its
/// chrono or time features): microseconds since 2000-01-01 UTC.
struct Timestamp(SystemTime);

impl ::sqlx::Type<Postgres> for Timestamp {
    fn type_info() -> PgTypeInfo {
        // `timestamptz`
        PgTypeInfo::with_oid(Oid(1184))
    }
}

impl Encode<'_, Postgres> for Timestamp {
    fn encode_by_ref(&self, buf: &mut PgArgumentBuffer) -> Result<IsNull, BoxDynError> {
        let epoch_2000 = SystemTime::UNIX_EPOCH + Duration::from_secs(946_684_800);
        let micros = match self.0.duration_since(epoch_2000) {
            Ok(after) => i64::try_from(after.as_micros())?,
            Err(before) => -i64::try_from(before.duration().as_micros())?,
        };
        buf.extend_from_slice(&micros.to_be_bytes());
        Ok(IsNull::No)
    }
}

/// sqlx's `Query::fetch_all` and its kin are `async fn`s generic over the executor,
/// whose futures the compiler cannot prove `Send` for every lifetime inside the
/// layer's; the methods of `&mut PgConnection`'s own `Executor` return boxed `Send`
/// futures. These send a statement through those.
pub(super) trait Via<'q>: ::sqlx::Execute<'q, Postgres> + Sized + 'q {
    fn fetch_all_via<'c>(
        self,
        conn: &'c mut PgConnection,
    ) -> BoxFuture<'c, Result<Vec<PgRow>, ::sqlx::Error>>
    where
        'q: 'c,
    {
        conn.fetch_all(self)
    }

    fn fetch_optional_via<'c>(
        self,
        conn: &'c mut PgConnection,
    ) -> BoxFuture<'c, Result<Option<PgRow>, ::sqlx::Error>>
    where
        'q: 'c,
    {
        conn.fetch_optional(self)
    }

    fn execute_via<'c>(
        self,
        conn: &'c mut PgConnection,
    ) -> BoxFuture<'c, Result<PgQueryResult, ::sqlx::Error>>
    where
        'q: 'c,
    {
        conn.execute(self)
    }
}

impl<'q> Via<'q> for Query<'q, Postgres, PgArguments> {}

impl<'q> Via<'q> for RawSql<'q> {}

/// A connection for a statement that must not queue behind the app's pool (which the
/// handlers may hold): an idle one of the pool if there is one, else one of its own,
/// made with the pool's options and closed after the statement. Behind a transaction
/// pooler, the statement runs in a transaction of its own (`transaction`): sqlx sends an
/// unnamed statement's parse and its execution in two exchanges, which the pooler may
/// give to two server sessions unless a transaction holds one (the execution then
/// finds no statement, or another session's).
struct Apart {
    conn: ApartConn,
    transaction: bool,
}

enum ApartConn {
    Pooled(PoolConnection<Postgres>),
    Own(PgConnection),
}

impl Apart {
    fn conn(&mut self) -> &mut PgConnection {
        match &mut self.conn {
            ApartConn::Pooled(conn) => conn,
            ApartConn::Own(conn) => conn,
        }
    }

    async fn done(mut self) {
        // `COMMIT` ends the transaction whether its statement succeeded or not (the
        // server rolls an aborted one back); a connection that cannot end it is closed
        // rather than given back to the pool in it.
        let ended = !self.transaction || PgTransactionManager::commit(self.conn()).await.is_ok();
        match self.conn {
            ApartConn::Pooled(conn) if !ended => {
                let _ = conn.close().await;
            }
            ApartConn::Pooled(_) => {}
            ApartConn::Own(conn) => {
                let _ = conn.close().await;
            }
        }
    }
}

/// `ROLLBACK` of the layer's transaction on `conn` (sent even if the handler ended it:
/// the server answers it outside any transaction with a warning).
pub(crate) async fn roll_back(conn: &mut PgConnection) -> Result<(), StoreError> {
    PgTransactionManager::rollback(conn).await.map_err(classify)
}

impl SqlxStore {
    /// A permit to claim in a transaction: half of the pool's connections at most wait
    /// on another request's row (see `PostgresStore::tx_claim_permit`).
    pub(crate) async fn tx_claim_permit(&self) -> tokio::sync::OwnedSemaphorePermit {
        match self.tx_claims.clone().acquire_owned().await {
            Ok(permit) => permit,
            Err(_) => unreachable!("the claim semaphore is never closed"),
        }
    }

    /// A connection for a transaction: one the store keeps, else one of the pool's.
    pub(crate) async fn tx_connection(&self) -> Result<SqlxConn, StoreError> {
        Ok(SqlxConn {
            conn: Some(self.lend().await?),
            held: None,
        })
    }

    /// [`apart`](Apart): an idle pooled connection, else one of the store's own; behind
    /// a transaction pooler, in a transaction of its own.
    async fn apart(&self) -> Result<Apart, StoreError> {
        let conn = match self.pool.try_acquire() {
            Some(conn) => ApartConn::Pooled(conn),
            None => {
                let options = self.pool.connect_options();
                let conn = PgConnection::connect_with(&options)
                    .await
                    .map_err(classify)?;
                ApartConn::Own(conn)
            }
        };
        let mut apart = Apart {
            conn,
            transaction: false,
        };
        if !self.persistent {
            PgTransactionManager::begin(apart.conn(), None)
                .await
                .map_err(classify)?;
            apart.transaction = true;
        }
        Ok(apart)
    }

    /// `BEGIN` with `claim_wait` as the transaction's `lock_timeout`, then the claim in
    /// it, which reads the backend's pid and sets the transaction's `lock_timeout` to
    /// `then_lock_timeout` once it has run (as `PostgresStore::begin_and_claim`, in two
    /// round trips: sqlx does not pipeline).
    /// Where transactions default to repeatable read or serializable, a claim that
    /// waited on a row committed meanwhile fails so: it is rolled back and sent again.
    pub(crate) async fn begin_and_claim(
        &self,
        conn: &mut PgConnection,
        claim_wait: Duration,
        request: &ClaimRequest<'_>,
        then_lock_timeout: Option<Duration>,
    ) -> Result<(Claim, Backend), StoreError> {
        self.start_purge();
        let mut attempt = 0;
        loop {
            let token = FencingToken::fresh();
            let begin = begin_claiming(claim_wait, token, then_lock_timeout);
            match self
                .claim_in_new_transaction(conn, begin, request, token)
                .await
            {
                Err(e) if lost_a_race(&e) && attempt < CLAIM_ATTEMPTS => {
                    attempt += 1;
                    self.send_rollback(conn).await?;
                }
                Ok((claim, backend)) => return Ok((claim, backend)),
                Err(e) => return Err(e),
            }
        }
    }

    /// `begin` (`begin_claiming`'s) and the claim in it, looking again while the key
    /// changes under it: the claim, and the transaction's start and backend.
    async fn claim_in_new_transaction(
        &self,
        conn: &mut PgConnection,
        begin: String,
        req: &ClaimRequest<'_>,
        token: FencingToken,
    ) -> Result<(Claim, Backend), StoreError> {
        // The claim's `BEGIN`, as sqlx's own: the connection is in a transaction to
        // sqlx, as it is to the server.
        PgTransactionManager::begin(conn, Some(begin.into()))
            .await
            .map_err(classify)?;
        for _ in 0..CLAIM_ATTEMPTS {
            let row = self
                .query(&self.sql.tx.claim)
                .bind(req.scope.as_str())
                .bind(req.key)
                .bind(req.fingerprint.as_bytes())
                .bind(ms(req.lease))
                .bind(ms(req.ttl))
                .bind(token.get())
                .bind(None::<i64>)
                .fetch_optional_via(&mut *conn)
                .await
                .map_err(classify)?
                .ok_or_else(|| {
                    StoreError::new(
                        StoreErrorKind::Unavailable,
                        "the claim found no transaction of its own (its BEGIN failed), and claimed nothing",
                    )
                })?;
            let row = SqlxRow(row);
            let pid = need(row.int4(col::TX_PID), col::TX_PID)?;
            let (found, started) = found(&row, req, self.sql.remember)?;
            let claim = match found {
                Found::Claim(claim) => claim,
                Found::TakeOver(seen) => self
                    .query(&self.sql.takeover)
                    .bind(req.scope.as_str())
                    .bind(req.key)
                    .bind(seen.token)
                    .bind(req.fingerprint.as_bytes())
                    .bind(ms(req.lease))
                    .bind(ms(req.ttl))
                    .bind(None::<i64>)
                    .fetch_optional_via(&mut *conn)
                    .await
                    .map_err(classify)?
                    .map(|row| need(SqlxRow(row).int8(0), 0))
                    .transpose()?
                    .map(|token| {
                        Claim::Acquired(Lease {
                            scope: req.scope.clone(),
                            key: Arc::from(req.key),
                            token: FencingToken::new(token),
                        })
                    }),
            };
            if let Some(claim) = claim {
                return Ok((claim, Backend { pid, started }));
            }
        }
        Err(StoreError::new(
            StoreErrorKind::Timeout,
            "the key kept changing while it was being claimed",
        ))
    }

    /// `ROLLBACK` of the layer's transaction on `conn`, waiting for its answer.
    pub(crate) async fn send_rollback(&self, conn: &mut PgConnection) -> Result<(), StoreError> {
        roll_back(conn).await
    }

    /// `COMMIT` of the layer's transaction on `conn`, waiting for its answer.
    /// Refused if the connection is not exactly in the layer's transaction to sqlx
    /// (the handler left a `Transaction` of its own open on it, leaked, and a `COMMIT`
    /// now would only release its savepoint).
    pub(crate) async fn send_commit(&self, conn: &mut PgConnection) -> Result<(), StoreError> {
        if PgTransactionManager::get_transaction_depth(conn) != 1 {
            return Err(StoreError::new(
                StoreErrorKind::Other,
                "the handler left a sqlx transaction of its own open on the request's connection; nothing was committed",
            ));
        }
        PgTransactionManager::commit(conn).await.map_err(classify)
    }

    /// Whether the transaction that claimed the key still holds `conn`, once the
    /// handler has run. Straight to the database, `true` unasked: the completion and
    /// the check before a `ROLLBACK` match only a row the transaction wrote, and find
    /// out themselves. Behind a transaction pooler, asked once, in one exchange
    /// ([`in_claim_transaction`]): a statement with parameters goes in two, and had the
    /// handler ended the transaction, the pooler could give them to two server
    /// sessions, the second executing another session's statement, or none.
    pub(crate) async fn in_claim_transaction(
        &self,
        conn: &mut SqlxConn,
    ) -> Result<bool, StoreError> {
        if self.persistent {
            return Ok(true);
        }
        if let Some(held) = conn.held {
            return Ok(held);
        }
        let sql = in_claim_transaction();
        let row = ::sqlx::raw_sql(&sql)
            .fetch_optional_via(conn)
            .await
            .map_err(classify)?;
        conn.held = Some(row.is_some());
        Ok(row.is_some())
    }

    /// Stores `response` under `lease` on `conn`, in the transaction that claimed it
    /// (see `PostgresStore::complete_in_transaction`): [`Fenced::LeaseLost`] if that
    /// transaction had ended ([`in_claim_transaction`](Self::in_claim_transaction)).
    pub(crate) async fn complete_in_transaction(
        &self,
        conn: &mut SqlxConn,
        lease: &Lease,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<Fenced, StoreError> {
        if !self.in_claim_transaction(conn).await? {
            return Ok(Fenced::LeaseLost);
        }
        let headers = StoredResponse::encode_headers(&response.headers);
        let id = self.key_id(&lease.scope, &lease.key);
        let rows = self
            .query(&self.sql.tx.complete)
            .bind(lease.scope.as_str())
            .bind(&*lease.key)
            .bind(lease.token.get())
            .bind(response.status.as_u16() as i16)
            .bind(&headers[..])
            .bind(&response.body[..])
            .bind(ms(ttl))
            .bind(&self.listener.channel)
            .bind(&id)
            .fetch_all_via(&mut *conn)
            .await
            .map_err(classify)?;
        Ok(Fenced::kept_if(rows.len() == 1))
    }

    /// Whether the transaction on `conn` is still the one that claimed `lease`.
    pub(crate) async fn still_ours(
        &self,
        conn: &mut SqlxConn,
        lease: &Lease,
    ) -> Result<bool, StoreError> {
        if !self.in_claim_transaction(conn).await? {
            return Ok(false);
        }
        let rows = self
            .query(&self.sql.tx.ours)
            .bind(lease.scope.as_str())
            .bind(&*lease.key)
            .bind(lease.token.get())
            .fetch_all_via(&mut *conn)
            .await
            .map_err(classify)?;
        Ok(rows.len() == 1)
    }

    /// How a transaction whose `COMMIT` was in doubt ended, read on a connection of
    /// the pool in a read committed transaction of its own (see
    /// `PostgresStore::committed_on`).
    pub(crate) async fn committed_elsewhere(
        &self,
        lease: &Lease,
        backend: &Backend,
        fingerprint: &Fingerprint,
        sent: &StoredResponse,
        lock_timeout: Duration,
    ) -> Result<Resolution, StoreError> {
        let mut conn = self.tx_connection().await?;
        // Read committed whatever the database's default: the read must see what
        // committed while the insert waited. Begun as sqlx's own, as the layer's are.
        let begin = begin(" ISOLATION LEVEL READ COMMITTED", lock_timeout);
        PgTransactionManager::begin(&mut conn, Some(begin.into()))
            .await
            .map_err(classify)?;
        let (scope, key) = (lease.scope.as_str(), &*lease.key);
        self.query(&self.sql.in_doubt_wait)
            .bind(scope)
            .bind(key)
            .bind(fingerprint.as_bytes())
            .fetch_all_via(&mut conn)
            .await
            .map_err(classify)?;
        let row = self
            .query(&self.sql.in_doubt_read)
            .bind(scope)
            .bind(key)
            .fetch_optional_via(&mut conn)
            .await
            .map_err(classify)?;
        let resolved = resolution(row.map(SqlxRow).as_ref(), lease, backend, fingerprint, sent);
        if self.send_rollback(&mut conn).await.is_ok() {
            conn.done();
        }
        resolved
    }

    /// The rows of `query`, a statement outside the claim's transaction, which has
    /// ended: on `conn` (back outside any transaction) straight to the database; on a
    /// connection [`apart`](Apart) with `None`, and always behind a transaction pooler,
    /// where only a transaction of its own keeps the statement's two exchanges on one
    /// server session.
    async fn outside(
        &self,
        conn: Option<&mut PgConnection>,
        query: Query<'_, Postgres, PgArguments>,
    ) -> Result<Vec<PgRow>, StoreError> {
        let rows = match conn {
            Some(conn) if self.persistent => query.fetch_all_via(conn).await,
            _ => {
                let mut apart = self.apart().await?;
                let rows = query.fetch_all_via(apart.conn()).await;
                apart.done().await;
                rows
            }
        };
        rows.map_err(classify)
    }

    /// Whether the claim of `lease`, made on `backend`, is committed `running` with
    /// nothing else (see `PostgresStore::claim_committed_alone`): on `conn`, or, with
    /// `None`, on a connection apart from the pool's queue.
    pub(crate) async fn claim_committed_alone(
        &self,
        conn: Option<&mut PgConnection>,
        lease: &Lease,
        backend: &Backend,
    ) -> Result<bool, StoreError> {
        let query = self
            .query(&self.sql.tx.claim_alone)
            .bind(lease.scope.as_str())
            .bind(&*lease.key)
            .bind(lease.token.get())
            .bind(Timestamp(backend.started));
        Ok(self.outside(conn, query).await?.len() == 1)
    }

    /// Renews for `duration` the lease of the claim of `lease`, made on `backend`, if
    /// it is committed `running` as the claim wrote it (see
    /// `PostgresStore::renew_committed_claim`).
    pub(crate) async fn renew_committed_claim(
        &self,
        lease: &Lease,
        backend: &Backend,
        duration: Duration,
    ) -> Result<bool, StoreError> {
        let mut apart = self.apart().await?;
        let renewed = self
            .query(&self.sql.tx.renew_alone)
            .bind(lease.scope.as_str())
            .bind(&*lease.key)
            .bind(lease.token.get())
            .bind(Timestamp(backend.started))
            .bind(ms(duration))
            .execute_via(apart.conn())
            .await;
        apart.done().await;
        Ok(renewed.map_err(classify)?.rows_affected() == 1)
    }

    /// Completes the key of `lease` with `response`, outside the transaction that
    /// claimed it, which ended under the layer (see `PostgresStore::finish_ended`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn finish_ended(
        &self,
        conn: Option<&mut PgConnection>,
        lease: &Lease,
        backend: &Backend,
        fingerprint: &Fingerprint,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        let headers = StoredResponse::encode_headers(&response.headers);
        let id = self.key_id(&lease.scope, &lease.key);
        let query = self
            .query(&self.sql.tx.finish_ended)
            .bind(lease.scope.as_str())
            .bind(&*lease.key)
            .bind(lease.token.get())
            .bind(fingerprint.as_bytes())
            .bind(response.status.as_u16() as i16)
            .bind(&headers[..])
            .bind(&response.body[..])
            .bind(ms(ttl))
            .bind(Timestamp(backend.started))
            .bind(&self.listener.channel)
            .bind(&id);
        Ok(self.outside(conn, query).await?.len() == 1)
    }

    /// Ends the transaction `backend` runs, from another session (see
    /// `PostgresStore::end_transaction`), on a connection apart from the pool's queue.
    pub(crate) async fn end_transaction(&self, backend: &Backend) -> Result<Ending, StoreError> {
        let mut apart = self.apart().await?;
        let row = self
            .query(&self.sql.tx.end)
            .bind(backend.pid)
            .bind(Timestamp(backend.started))
            .fetch_optional_via(apart.conn())
            .await;
        apart.done().await;
        Ok(ending(row.map_err(classify)?.map(SqlxRow).as_ref()))
    }

    /// Forgets the steps of `lease`'s key on `conn`, in the claim's transaction; not
    /// if that transaction had ended ([`in_claim_transaction`](Self::in_claim_transaction)),
    /// which the completion then finds.
    pub(crate) async fn forget_steps_on(
        &self,
        conn: &mut SqlxConn,
        lease: &Lease,
    ) -> Result<(), StoreError> {
        if !self.in_claim_transaction(conn).await? {
            return Ok(());
        }
        self.query(&self.sql.steps.forget)
            .bind(lease.scope.as_str())
            .bind(&*lease.key)
            .execute_via(&mut *conn)
            .await
            .map(drop)
            .map_err(classify)
    }

    /// The steps recorded for the request of `fingerprint` under the key of a claim in
    /// a transaction, read apart from it (see `PostgresStore::steps_apart`).
    pub(crate) async fn steps_apart(
        &self,
        lease: &Lease,
        fingerprint: &Fingerprint,
    ) -> Result<Vec<RecordedStep>, StoreError> {
        let rows = again_if_it_lost_a_race(|| async {
            let mut apart = self.apart().await?;
            let rows = self
                .query(&self.sql.steps.read_apart)
                .bind(lease.scope.as_str())
                .bind(&*lease.key)
                .bind(fingerprint.as_bytes())
                .fetch_all_via(apart.conn())
                .await;
            apart.done().await;
            rows.map_err(classify)
        })
        .await?;
        rows.into_iter().map(|row| step(&SqlxRow(row))).collect()
    }

    /// Records `recorded` apart from the claim's transaction of `backend`, while that
    /// transaction runs (see `PostgresStore::record_step_apart`).
    pub(crate) async fn record_step_apart(
        &self,
        lease: &Lease,
        backend: &Backend,
        fingerprint: &Fingerprint,
        recorded: &RecordedStep,
    ) -> Result<Fenced, StoreError> {
        let n = place(recorded)?;
        let rows = again_if_it_lost_a_race(|| async {
            let mut apart = self.apart().await?;
            let rows = self
                .query(&self.sql.steps.record_apart)
                .bind(lease.scope.as_str())
                .bind(&*lease.key)
                .bind(lease.token.get())
                .bind(n)
                .bind(recorded.name.as_str())
                .bind(&recorded.result[..])
                .bind(fingerprint.as_bytes())
                .bind(backend.pid)
                .bind(Timestamp(backend.started))
                .fetch_all_via(apart.conn())
                .await;
            apart.done().await;
            rows.map_err(classify)
        })
        .await?;
        Ok(Fenced::kept_if(rows.len() == 1))
    }
}
