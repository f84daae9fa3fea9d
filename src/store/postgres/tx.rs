//! The transaction API of transactional mode: `BEGIN` with the claim, the completion
//! that only a live transaction of the claim's can make, `COMMIT` and `ROLLBACK`, and,
//! for a transaction that ended under the layer or that the layer gives up on, the
//! statements that find out, finish the key, or end the transaction on the server.
//!
//! Each function sends its statements and waits for their answers; bounding them in
//! time is the caller's part (`crate::transactional`), and so is closing a connection
//! given up on midway (dropping its `Checkout`).

use std::time::{Duration, SystemTime};

use deadpool_postgres::ClientWrapper;
use tokio_postgres::{Row, types::ToSql};

use super::{
    Checkout, PostgresStore,
    claim::{Within, ms},
    row::{Columns, need},
    sql::{Statement, params},
};
use crate::{
    Fingerprint, StoredResponse,
    store::{Claim, ClaimRequest, Fenced, FencingToken, Lease, StoreError},
};

/// The condition that holds only for a row version this transaction wrote: its `xmin`
/// is the transaction's id. The claim inserted or updated the row in the transaction
/// (a plain function call, no subtransaction), so while that transaction lasts the
/// row's `xmin` is its id; once it has ended (a `COMMIT` or `ROLLBACK` sent by the
/// handler), the statement runs in another transaction, or in none, and nothing
/// matches. `_if_assigned` assigns no id to a statement outside that transaction.
/// PostgreSQL 13 or later.
pub(super) const WRITTEN_BY_THIS_TRANSACTION: &str =
    " AND xmin = pg_current_xact_id_if_assigned()::xid";

/// A setting local to the transaction a claim's `BEGIN` opens, set there to the claim's
/// token (`begin_claiming`): the claim, sent right behind the `BEGIN` in the same round
/// trip as a message of its own, runs only where it holds
/// (`Statements::claim`), that is, in that transaction.
const CLAIM_MARK: &str = "tower_idempotency.claim";

/// A setting local to a claim's transaction, set by its `BEGIN` (`begin_claiming`) to
/// the `lock_timeout` the handler's statements get: the claim itself sets the
/// transaction's `lock_timeout` to it once it has run (`Statements::claim`), so that
/// the claim waits on another request's row for its own bound and the handler's
/// statements for theirs, with no statement of its own to say so.
const THEN_LOCK_TIMEOUT: &str = "tower_idempotency.lock_timeout";

/// The server session and the transaction a claim opened: what tells that transaction
/// apart from any other, on that backend or behind a pooler that lends it to others
/// once the transaction ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Backend {
    /// `pg_backend_pid()` inside the transaction.
    pub(super) pid: i32,
    /// The transaction's start (`now()` in it): `xact_start` in `pg_stat_activity`
    /// while it runs, and `created_at` of the claim row it inserted or took over.
    pub(super) started: SystemTime,
}

/// Statements of transactional mode (see `Sql`).
pub(super) struct Statements {
    /// The claim, in the transaction its `BEGIN` opened, or nowhere.
    pub(super) claim: Statement,
    /// The completion, matching only the row this transaction wrote.
    pub(super) complete: Statement,
    /// Whether the claim row is still this transaction's.
    pub(super) ours: Statement,
    /// Whether the claim row is committed `running`, as the claim wrote it.
    pub(super) claim_alone: Statement,
    /// Renews the lease of a claim row committed `running`, as the claim wrote it.
    pub(super) renew_alone: Statement,
    /// Completes the key after its transaction ended under the layer.
    pub(super) finish_ended: Statement,
    /// Ends a transaction on the server from another session.
    pub(super) end: Statement,
}

impl Statements {
    /// `t`: the qualified table; `claim`: the claim's text (one row, from
    /// `FROM (VALUES (1)) LEFT JOIN`, its token `$6`); `complete`: the completion,
    /// restricted to the row this transaction wrote; `insert_completed`: the function
    /// that inserts a completed row into a table in generations (`generations.sql`), if
    /// it is one.
    pub(super) fn new(
        t: &str,
        claim: &str,
        complete: Statement,
        insert_completed: Option<&str>,
    ) -> Self {
        let ttl = "$8::bigint * interval '1 millisecond'";
        // No row at all: a completed one is inserted, unless another request inserted
        // the key in the meantime. In generations, the key is unique across them only
        // through the function, which serialises its inserts (see `generations`).
        let fresh = match insert_completed {
            None => format!(
                "INSERT INTO {t} (scope, key, fingerprint, state, token, expires_at,
                                 completed_at, status, headers, body)
                SELECT $1, $2, $4, 'completed', $3, statement_timestamp() + {ttl},
                       statement_timestamp(), $5, $6, $7
                WHERE NOT EXISTS (SELECT 1 FROM ours)
                ON CONFLICT (scope, key) DO NOTHING
                RETURNING false AS waiters"
            ),
            Some(insert) => "SELECT false AS waiters
                WHERE CASE WHEN EXISTS (SELECT 1 FROM ours) THEN false
                           ELSE {insert}($1, $2, $4, $3, $8, $5, $6, $7) END"
                .replace("{insert}", insert),
        };
        Self {
            // The claim goes on the wire right behind its `BEGIN`, as a message of its
            // own: a `BEGIN` that fails before it runs (a cancel request that reaches
            // it as it starts, say, as a client that hangs up sends one) leaves the
            // session outside any transaction, where the claim alone would commit the
            // key `running`, with nobody to finish it. Only the transaction that `BEGIN`
            // opened carries the mark with this claim's token: anywhere else the
            // filter, which no row depends on, holds for none, and nothing is called.
            //
            // Once it has run (its row read, and so its wait on another request's row
            // over: the subquery, which calls volatile functions, is not merged into
            // the outer query), the claim also reads the backend's pid and sets the
            // transaction's `lock_timeout` to the handler's (`THEN_LOCK_TIMEOUT`, when
            // the `BEGIN` set it; an unset or reset placeholder reads as '' and keeps
            // the claim's): the statements a separate `SET` and `SELECT` would cost.
            claim: Statement::new(
                format!(
                    "SELECT c.*, pg_backend_pid() AS pid,
                            set_config('lock_timeout',
                                       coalesce(nullif(current_setting('{THEN_LOCK_TIMEOUT}', true), ''),
                                                current_setting('lock_timeout')),
                                       true)
                     FROM ({claim} WHERE current_setting('{CLAIM_MARK}', true) = $6::text) AS c"
                ),
                params::CLAIM,
            ),
            complete,
            ours: Statement::new(
                format!(
                    "SELECT 1 FROM {t} WHERE scope = $1 AND key = $2 AND token = $3{WRITTEN_BY_THIS_TRANSACTION}"
                ),
                params::KEY_AND_TOKEN,
            ),
            // The claim's signature: its token, and `created_at` the claim's
            // transaction start (no other claim, a takeover with the same token
            // included, has both), still `running`: committed so by a `COMMIT` of the
            // handler's, since the layer's own commits it completed.
            claim_alone: Statement::new(
                format!(
                    "SELECT 1 FROM {t} WHERE scope = $1 AND key = $2 AND token = $3
                                         AND state = 'running' AND created_at = $4"
                ),
                params::CLAIM_SIGNATURE,
            ),
            // The same row, its lease renewed. It matches nothing while the claim's
            // transaction is open, and never waits on it: to other sessions, the row
            // that transaction inserted does not exist, and one it took over still
            // carries the token before the takeover's.
            renew_alone: Statement::new(
                format!(
                    "UPDATE {t} SET locked_until = now() + {lease},
                                    expires_at = greatest(expires_at, now() + {lease})
                     WHERE scope = $1 AND key = $2 AND token = $3
                       AND state = 'running' AND created_at = $4",
                    lease = "$5::bigint * interval '1 millisecond'",
                ),
                params::RENEW_ALONE,
            ),
            // Outside any transaction of the claim's: the claim row, committed
            // `running` by the handler's own COMMIT (its token, and `created_at` the
            // claim's transaction start: no other claim, a takeover with the same token
            // included, has both), is completed; a row the claim would have been free
            // to take over (the handler's ROLLBACK restored it) is taken over completed,
            // its token one more; no row at all (the handler's ROLLBACK removed the
            // insert) is inserted completed. A row another request holds is left alone.
            finish_ended: Statement::new(
                format!(
                    "WITH ours AS (
                        UPDATE {t} SET state = 'completed', locked_until = NULL, fingerprint = $4,
                               status = $5, headers = $6, body = $7,
                               token = CASE WHEN token = $3 AND state = 'running' AND created_at = $9
                                            THEN token ELSE token + 1 END,
                               completed_at = statement_timestamp(),
                               expires_at = statement_timestamp() + {ttl}
                        WHERE scope = $1 AND key = $2
                          AND ((token = $3 AND state = 'running' AND created_at = $9)
                            OR ((state = 'completed' OR locked_until <= now())
                                AND (expires_at <= now() OR (state = 'running' AND fingerprint = $4))))
                        RETURNING waiters),
                     fresh AS ({fresh})
                     SELECT CASE WHEN waiters THEN pg_notify($10, $11) END FROM ours
                     UNION ALL SELECT NULL FROM fresh"
                ),
                params::FINISH_ENDED,
            ),
            // Only while that backend still runs that transaction: a backend whose
            // session ended may be another's now, and one behind a pooler serves
            // other clients once the transaction is over. Its row tells those apart:
            // none, the session is gone; `state` null, this role may not see it;
            // `disabled`, the session does not report its transactions
            // (`track_activities` off), so its `xact_start` tells nothing.
            end: Statement::new(
                "SELECT CASE WHEN xact_start = $2 THEN pg_terminate_backend(pid) END,
                             coalesce(state <> 'disabled', false)
                      FROM pg_stat_activity WHERE pid = $1"
                    .to_owned(),
                params::END,
            ),
        }
    }
}

/// `BEGIN` (with `isolation`, e.g. `" ISOLATION LEVEL READ COMMITTED"`, or `""`) and
/// the transaction's `lock_timeout`, as one simple query that also returns the
/// backend's pid.
pub(super) fn begin(isolation: &str, lock_timeout: Duration) -> String {
    format!(
        "BEGIN{isolation}; {}; SELECT pg_backend_pid()",
        set_lock_timeout(lock_timeout)
    )
}

/// `BEGIN` for a claim sent right behind it, with `token`, `lock_timeout` the claim's
/// bound on another request's row: the transaction it opens carries the mark the claim
/// checks, and, with `then_lock_timeout`, the `lock_timeout` the claim sets once it
/// has run (see `Statements::claim`, which also reads the backend's pid). `SET LOCAL`s,
/// not a `SELECT` of `set_config`s: utility statements, with nothing to plan and no
/// row to send, they cost PostgreSQL about 25 µs less a request (docs/benchmarks.md).
/// If the `BEGIN` fails, the rest of the query is not run.
pub(super) fn begin_claiming(
    lock_timeout: Duration,
    token: FencingToken,
    then_lock_timeout: Option<Duration>,
) -> String {
    let then = then_lock_timeout
        .map(|then| format!("; SET LOCAL {THEN_LOCK_TIMEOUT} = {}", millis(then)))
        .unwrap_or_default();
    format!(
        "BEGIN; SET LOCAL {CLAIM_MARK} = '{}'; {}{then}",
        token.get(),
        set_lock_timeout(lock_timeout),
    )
}

/// A statement that answers a row only in the transaction a claim's `BEGIN` opened
/// (its mark set, `begin_claiming`), with no parameters: sent in one exchange. Behind
/// a transaction pooler it reaches the claim's server session while that transaction
/// holds it; once the transaction has ended (a `COMMIT` or `ROLLBACK` of the
/// handler's), an idle session, or the handler's next transaction, neither of which
/// carries the mark.
#[cfg(feature = "sqlx")]
pub(super) fn in_claim_transaction() -> String {
    format!("SELECT 1 WHERE current_setting('{CLAIM_MARK}', true) <> ''")
}

/// A `lock_timeout` in milliseconds, at least 1: zero would mean no bound.
fn millis(lock_timeout: Duration) -> u128 {
    lock_timeout.as_millis().max(1)
}

/// `SET LOCAL lock_timeout`, in milliseconds (at least 1: zero would mean no bound).
pub(super) fn set_lock_timeout(lock_timeout: Duration) -> String {
    format!("SET LOCAL lock_timeout = {}", millis(lock_timeout))
}

/// `ROLLBACK` on `conn`, then the connection back to the pool; closed instead (which
/// rolls back) if the server does not answer within `bound`, or fails.
pub(crate) async fn roll_back_or_close(conn: Checkout, bound: Duration) {
    if let Some(conn) = roll_back_keeping(conn, bound).await {
        conn.done();
    }
}

/// `ROLLBACK` on `conn`, which is given back outside any transaction; `None` if the
/// server does not answer within `bound`, or fails (the connection is then closed,
/// which rolls back).
pub(crate) async fn roll_back_keeping(conn: Checkout, bound: Duration) -> Option<Checkout> {
    let rolled_back = tokio::time::timeout(bound, conn.batch_execute("ROLLBACK")).await;
    kept_if_rolled_back(conn, rolled_back)
}

/// `conn` after its `ROLLBACK` answered `rolled_back` within its bound: kept, outside
/// any transaction, if the server rolled back; else `None`, dropped, which closes it
/// (and so rolls back).
pub(crate) fn kept_if_rolled_back<C, E: std::fmt::Display>(
    conn: C,
    rolled_back: Result<Result<(), E>, tokio::time::error::Elapsed>,
) -> Option<C> {
    match rolled_back {
        Ok(Ok(())) => Some(conn),
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "rollback failed; closing the connection");
            None
        }
        Err(_) => {
            tracing::warn!("no answer to ROLLBACK in time; closing the connection");
            None
        }
    }
}

/// `COMMIT` on `client`, as the driver answers it.
pub(crate) async fn commit_on(client: &ClientWrapper) -> Result<(), tokio_postgres::Error> {
    client.batch_execute("COMMIT").await
}

/// What [`PostgresStore::end_transaction`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ending {
    /// The session ran the transaction, and is terminated: the transaction rolls back.
    Terminated,
    /// The session runs that transaction no more, but lives on: the transaction ended
    /// on it (its `COMMIT` or `ROLLBACK`), or, behind a pooler, it serves another
    /// client now.
    AlreadyEnded,
    /// No session has that pid: it ended, and the transaction with it (rolled back,
    /// unless committed before).
    SessionGone,
    /// The session could not be told apart or signalled: it runs as a role whose
    /// sessions this one may not see, it does not report its transactions
    /// (`track_activities` off), or the signal failed.
    CannotEnd,
}

/// How a transaction whose `COMMIT` was in doubt ended ([`PostgresStore::committed_on`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Resolution {
    /// The claim committed, completed with the response sent.
    Committed,
    /// Nothing of it committed.
    NotCommitted,
    /// The claim committed `running`, without its completion: the transaction had
    /// ended under the layer, committed by the handler.
    ClaimAlone,
}

/// How a transaction whose `COMMIT` was in doubt ended, from the key's `row` as
/// `in_doubt_read` returns it (`None`: no row), whichever driver read it (see
/// [`PostgresStore::committed_on`]).
pub(super) fn resolution(
    row: Option<&impl Columns>,
    lease: &Lease,
    backend: &Backend,
    fingerprint: &Fingerprint,
    sent: &StoredResponse,
) -> Result<Resolution, StoreError> {
    let Some(row) = row else {
        return Ok(Resolution::NotCommitted);
    };
    if FencingToken::new(need(row.int8(0), 0)?) != lease.token {
        return Ok(Resolution::NotCommitted);
    }
    let state = need(row.text(1), 1)?;
    if state == "running" && row.time(6) == Some(backend.started) {
        return Ok(Resolution::ClaimAlone);
    }
    let ours = state == "completed"
        && row.bytes(2) == Some(fingerprint.as_bytes())
        && row.int2(3) == Some(sent.status.as_u16() as i16)
        && row.bytes(4) == Some(&StoredResponse::encode_headers(&sent.headers)[..])
        && row.bytes(5) == Some(&sent.body[..]);
    Ok(if ours {
        Resolution::Committed
    } else {
        Resolution::NotCommitted
    })
}

/// What [`PostgresStore::end_transaction`] found, from the row of `end` (`None`: no
/// session has that pid), whichever driver read it.
pub(super) fn ending(row: Option<&impl Columns>) -> Ending {
    match row {
        None => Ending::SessionGone,
        Some(row) if row.boolean(1) != Some(true) => Ending::CannotEnd,
        Some(row) => match row.boolean(0) {
            Some(true) => Ending::Terminated,
            Some(false) => Ending::CannotEnd,
            None => Ending::AlreadyEnded,
        },
    }
}

impl PostgresStore {
    /// Sends `BEGIN`, with `claim_wait` as the transaction's `lock_timeout`, and the
    /// claim together, one round trip: the claim with the database's `now()` and the pid
    /// of the backend that runs it. The claim runs in that transaction or not at all: if
    /// the `BEGIN` fails, nothing is claimed. With `then_lock_timeout`, the claim sets
    /// the transaction's `lock_timeout` to it once it has run: the claim waits on
    /// another request's row for `claim_wait`, and the handler's statements for this
    /// one. `BEGIN` and two or three `SET LOCAL`s in one simple query, the claim, and,
    /// for a key taken over, its `UPDATE`.
    pub(crate) async fn begin_and_claim(
        &self,
        client: &ClientWrapper,
        claim_wait: Duration,
        request: &ClaimRequest<'_>,
        token: FencingToken,
        then_lock_timeout: Option<Duration>,
    ) -> Result<(Claim, Backend), StoreError> {
        let failed = super::errors::unavailable;
        // Prepared first (once per connection), so that the claim's execution goes on
        // the wire right behind the `BEGIN`. (Unnamed, it goes whole at its first poll.)
        self.prepare_on(client, &self.sql.tx.claim).await?;
        let begin = begin_claiming(claim_wait, token, then_lock_timeout);
        let (begun, claim) = tokio::join!(
            client.batch_execute(&begin),
            // Judged by the transaction, not by a holder's liveness: its rollback frees
            // the key of a process that dies.
            self.claim_within(Within::ItsTransaction, client, request, token, None),
        );
        begun.map_err(failed)?;
        let (claim, started, pid) = claim?;
        let pid = pid.ok_or_else(|| super::errors::corrupt("the claim returned no backend pid"))?;
        Ok((claim, Backend { pid, started }))
    }

    /// `BEGIN ISOLATION LEVEL READ COMMITTED`, with `lock_timeout`.
    pub(crate) async fn begin_read_committed(
        &self,
        client: &ClientWrapper,
        lock_timeout: Duration,
    ) -> Result<(), StoreError> {
        let failed = super::errors::unavailable;
        client
            .batch_execute(&begin(" ISOLATION LEVEL READ COMMITTED", lock_timeout))
            .await
            .map_err(failed)
    }

    /// Sends `ROLLBACK` on `client` and waits for its answer; the connection stays the
    /// caller's (to begin another transaction on, say).
    pub(crate) async fn send_rollback(&self, client: &ClientWrapper) -> Result<(), StoreError> {
        let failed = super::errors::unavailable;
        client.batch_execute("ROLLBACK").await.map_err(failed)
    }

    /// Stores `response` under `lease` on `client`, in the transaction that claimed it:
    /// [`LeaseLost`](Fenced::LeaseLost) when that transaction has ended (the completion
    /// then runs outside it, and changes nothing).
    pub(crate) async fn complete_in_transaction(
        &self,
        client: &ClientWrapper,
        lease: &Lease,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<Fenced, StoreError> {
        self.complete_with(&self.sql.tx.complete, client, lease, response, ttl)
            .await
    }

    /// Prepares the completion statement on `client` (a no-op once cached), so that its
    /// execution can be pipelined with a `COMMIT`.
    pub(crate) async fn prepare_completion(
        &self,
        client: &ClientWrapper,
    ) -> Result<(), StoreError> {
        self.prepare_on(client, &self.sql.tx.complete).await
    }

    /// How the transaction that claimed `lease` for `fingerprint` (on `backend`) and sent
    /// `sent` as its completion ended, once it has: for a `COMMIT` in doubt. `client` is
    /// in a read committed transaction of its own, which the caller rolls back.
    ///
    /// The row then carries that claim's token, completed with that response, only if
    /// it committed. A duplicate's claim cannot be taken for it: a fresh claim's token is
    /// drawn at random, and the read sees the row as the transaction left it unless a
    /// duplicate that was waiting on it has taken it and committed in the moment since.
    /// Only a takeover of an expired row gets the same token (one more than the row's);
    /// that duplicate would also need the same input and the same stored response. The
    /// check relies on the record outliving it: a TTL of milliseconds, with a purge or a
    /// takeover in between, reads as not committed. The row still `running` with that
    /// token, created when the transaction started, is the claim committed without its
    /// completion ([`Resolution::ClaimAlone`]).
    pub(crate) async fn committed_on(
        &self,
        client: &ClientWrapper,
        lease: &Lease,
        backend: &Backend,
        fingerprint: &Fingerprint,
        sent: &StoredResponse,
    ) -> Result<Resolution, StoreError> {
        let (scope, key) = (lease.scope.as_str(), &*lease.key);
        let fp: &[u8] = fingerprint.as_bytes();
        self.query_on(client, &self.sql.in_doubt_wait, &[&scope, &key, &fp])
            .await?;
        let rows = self
            .query_on(client, &self.sql.in_doubt_read, &[&scope, &key])
            .await?;
        resolution(rows.first(), lease, backend, fingerprint, sent)
    }

    /// Prepares the check of [`still_ours`](Self::still_ours) on `client` (a no-op
    /// once cached), so that it can be pipelined with a `ROLLBACK`.
    pub(crate) async fn prepare_ours(&self, client: &ClientWrapper) -> Result<(), StoreError> {
        self.prepare_on(client, &self.sql.tx.ours).await
    }

    /// Whether the transaction on `client` is still the one that claimed `lease`.
    pub(crate) async fn still_ours(
        &self,
        client: &ClientWrapper,
        lease: &Lease,
    ) -> Result<bool, StoreError> {
        let params: [&(dyn ToSql + Sync); 3] = [&lease.scope.as_str(), &&*lease.key, &lease.token];
        let rows = self.query_on(client, &self.sql.tx.ours, &params).await?;
        Ok(rows.len() == 1)
    }

    /// Whether the claim of `lease`, made on `backend`, is committed `running` with
    /// nothing else (see `Statements::claim_alone`): the handler committed the
    /// transaction that made it. Outside that transaction: on `client`, or, with `None`,
    /// on a connection that does not wait behind the pool (see `running_client`).
    pub(crate) async fn claim_committed_alone(
        &self,
        client: Option<&ClientWrapper>,
        lease: &Lease,
        backend: &Backend,
    ) -> Result<bool, StoreError> {
        let params: [&(dyn ToSql + Sync); 4] = [
            &lease.scope.as_str(),
            &&*lease.key,
            &lease.token,
            &backend.started,
        ];
        let rows = self
            .query_apart(client, &self.sql.tx.claim_alone, &params)
            .await?;
        Ok(rows.len() == 1)
    }

    /// Renews for `duration` the lease of the claim of `lease`, made on `backend`, if it
    /// is committed `running` as the claim wrote it (the handler committed the
    /// transaction that made it); `Ok(false)` if not, as while that transaction is
    /// open. On a connection that does not wait behind the pool (`running_client`).
    pub(crate) async fn renew_committed_claim(
        &self,
        lease: &Lease,
        backend: &Backend,
        duration: Duration,
    ) -> Result<bool, StoreError> {
        let params: [&(dyn ToSql + Sync); 5] = [
            &lease.scope.as_str(),
            &&*lease.key,
            &lease.token,
            &backend.started,
            &ms(duration),
        ];
        let client = self.running_client().await?;
        let renewed = client
            .answer(self.execute_on(&client, &self.sql.tx.renew_alone, &params))
            .await;
        client.done(&renewed);
        renewed.map(|n| n == 1)
    }

    /// Runs `sql` on `client`, or, with `None`, on an idle pooled connection taken
    /// without waiting, else on the store's reserve (`running_client`): a statement
    /// for a claim the handler may have committed `running`, which must not queue
    /// behind a pool that the handlers hold.
    async fn query_apart(
        &self,
        client: Option<&ClientWrapper>,
        sql: &Statement,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<Row>, StoreError> {
        if let Some(client) = client {
            return self.query_on(client, sql, params).await;
        }
        let client = self.running_client().await?;
        let rows = client.answer(self.query_on(&client, sql, params)).await;
        client.done(&rows);
        rows
    }

    /// Completes the key of `lease` with `response`, outside the transaction that
    /// claimed it, which ended under the layer (see `Statements::finish_ended`):
    /// `Ok(false)` when another request holds the key. On `client`, or, with `None`, as
    /// [`query_apart`](Self::query_apart) runs it: with the transaction's connection
    /// gone, the claim may be committed `running`, and the pool held by the handlers.
    pub(crate) async fn finish_ended(
        &self,
        client: Option<&ClientWrapper>,
        lease: &Lease,
        backend: &Backend,
        fingerprint: &Fingerprint,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        let status = response.status.as_u16() as i16;
        let headers = StoredResponse::encode_headers(&response.headers);
        let (fp, h, b): (&[u8], &[u8], &[u8]) = (fingerprint.as_bytes(), &headers, &response.body);
        let id = self.key_id(&lease.scope, &lease.key);
        let params: [&(dyn ToSql + Sync); 11] = [
            &lease.scope.as_str(),
            &&*lease.key,
            &lease.token,
            &fp,
            &status,
            &h,
            &b,
            &ms(ttl),
            &backend.started,
            &self.listener.channel(),
            &id,
        ];
        let rows = self
            .query_apart(client, &self.sql.tx.finish_ended, &params)
            .await?;
        Ok(rows.len() == 1)
    }

    /// Ends the transaction `backend` runs, from another session: its session is
    /// terminated, which rolls the transaction back and lets its locks go, only while it
    /// still runs that transaction ([`Ending`] says what was found). On an idle pooled
    /// connection taken without waiting, else on the store's reserve (`running_client`):
    /// the pool may be exhausted by the very work that keeps the transaction, and a
    /// transaction left open keeps its row lock, and so its key.
    pub(crate) async fn end_transaction(&self, backend: &Backend) -> Result<Ending, StoreError> {
        let params: [&(dyn ToSql + Sync); 2] = [&backend.pid, &backend.started];
        let rows = self.query_apart(None, &self.sql.tx.end, &params).await?;
        Ok(ending(rows.first()))
    }
}
