//! Recorded steps (migration 0005): a running claim's steps read, and one recorded,
//! fenced by the claim's token, each in one statement on a running claim's connection
//! (`running_client`: a reserve connection is set up as the app says).

use deadpool_postgres::ClientWrapper;
use tokio_postgres::types::{ToSql, Type};

use super::{
    PostgresStore,
    errors::{again_if_it_lost_a_race, corrupt},
    row::{Columns, need},
    sql::Statement,
    tx::Backend,
};
use crate::{
    Fingerprint, Scope,
    store::{Fenced, Lease, Orphan, RecordedStep, StoreError, StoreErrorKind},
};

/// scope, key, token.
const READ: &[Type] = &[Type::TEXT, Type::TEXT, Type::INT8];
/// scope, key, token, n, name, result.
const RECORD: &[Type] = &[
    Type::TEXT,
    Type::TEXT,
    Type::INT8,
    Type::INT4,
    Type::TEXT,
    Type::BYTEA,
];
/// name, limit.
const ORPHANS: &[Type] = &[Type::TEXT, Type::INT8];
/// scope, key, fingerprint.
const READ_APART: &[Type] = &[Type::TEXT, Type::TEXT, Type::BYTEA];
/// scope, key, token, n, name, result, fingerprint, the claim's backend pid, its
/// transaction's start.
const RECORD_APART: &[Type] = &[
    Type::TEXT,
    Type::TEXT,
    Type::INT8,
    Type::INT4,
    Type::TEXT,
    Type::BYTEA,
    Type::BYTEA,
    Type::INT4,
    Type::TIMESTAMPTZ,
];

/// The names of the steps' table and of what forgets them, and their statements.
pub(super) struct Statements {
    /// `<table>_steps`, schema-qualified.
    pub(super) table: String,
    pub(super) forget_function: String,
    /// The triggers' names (a trigger belongs to its table: not schema-qualified).
    pub(super) forget_on_update: String,
    pub(super) forget_on_delete: String,
    /// A running claim's steps, in order, if its token still holds it: one row with
    /// NULLs for a claim without steps, none for a lease lost.
    pub(super) read: Statement,
    /// A step recorded, if the token still holds the key: the claim's row is marked
    /// (which takes its lock, so that a takeover waits for the record to commit, and
    /// its token is the one that holds it after), and the step inserted, or written
    /// again over one this holder recorded before (its answer lost). No row back: the
    /// lease was lost, and nothing was recorded.
    pub(super) record: Statement,
    /// Transactional mode's own, sent on a connection apart from the claim's
    /// transaction, so that a step recorded stays recorded when that transaction rolls
    /// back: the steps of a request (its fingerprint), in order.
    pub(super) read_apart: Statement,
    /// A step recorded while the claim's transaction runs (its session still in that
    /// transaction, by `pg_stat_activity`): a holder whose transaction ended (killed,
    /// its connection lost), and whose claim a retry may hold now, records nothing.
    pub(super) record_apart: Statement,
    /// The steps of a key forgotten, in the claim's transaction, which commits with
    /// the response: rolled back, they stay for a retry.
    pub(super) forget: Statement,
    /// The resumable keys registered as `$1` whose holder is gone (migration 0004's
    /// judgement, as the claim asks it), at most `$2`, with their requests (kept as the
    /// step of place -1, under the name registered).
    pub(super) orphans: Statement,
    /// Up to a thousand steps transactional mode recorded a day ago or more, for keys
    /// never completed (rolled back, never retried): the background purge's.
    pub(super) forget_stale: String,
    /// The steps whose key has no row marked as having them: left by a generation
    /// emptied whole (`TRUNCATE` fires no trigger).
    pub(super) forget_orphans: String,
}

impl Statements {
    pub(super) fn new(schema: &str, table: &str, qualified: &str) -> Self {
        let steps = format!("\"{schema}\".\"{table}_steps\"");
        let holder_gone = format!("\"{schema}\".\"{table}_holder_gone\"");
        let grace = super::claim::ms(super::liveness::GRACE);
        Self {
            orphans: Statement::new(
                format!(
                    "SELECT t.scope, t.key, t.fingerprint, s.result
                     FROM {steps} AS s JOIN {qualified} AS t ON t.scope = s.scope AND t.key = s.key
                     WHERE s.n = -1 AND s.name = $1 AND t.state = 'running' AND t.steps
                       AND t.holder IS NOT NULL AND t.locked_until > now()
                       AND {holder_gone}(t.holder, t.created_at, {grace})
                     LIMIT $2"
                ),
                ORPHANS,
            ),
            read: Statement::new(
                format!(
                    "SELECT s.n, s.name, s.result
                     FROM {qualified} AS t
                     LEFT JOIN {steps} AS s ON t.steps AND s.scope = t.scope AND s.key = t.key AND s.n >= 0
                     WHERE t.scope = $1 AND t.key = $2 AND t.token = $3 AND t.state = 'running'
                     ORDER BY s.n"
                ),
                READ,
            ),
            record: Statement::new(
                format!(
                    "WITH held AS (
                        UPDATE {qualified} SET steps = true
                        WHERE scope = $1 AND key = $2 AND token = $3 AND state = 'running'
                        RETURNING scope, key)
                     INSERT INTO {steps} AS s (scope, key, n, name, token, result)
                     SELECT scope, key, $4, $5, $3, $6 FROM held
                     ON CONFLICT (scope, key, n) DO UPDATE
                     SET name = excluded.name, token = excluded.token, result = excluded.result,
                         recorded_at = now()
                     RETURNING 1"
                ),
                RECORD,
            ),
            read_apart: Statement::new(
                format!(
                    "SELECT n, name, result FROM {steps}
                     WHERE scope = $1 AND key = $2 AND fingerprint = $3 AND n >= 0 ORDER BY n"
                ),
                READ_APART,
            ),
            record_apart: Statement::new(
                format!(
                    "INSERT INTO {steps} AS s (scope, key, n, name, token, result, fingerprint)
                     SELECT $1, $2, $4, $5, $3, $6, $7
                     WHERE EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $8 AND xact_start = $9)
                     ON CONFLICT (scope, key, n) DO UPDATE
                     SET name = excluded.name, token = excluded.token, result = excluded.result,
                         fingerprint = excluded.fingerprint, recorded_at = now()
                     RETURNING 1"
                ),
                RECORD_APART,
            ),
            forget: Statement::new(
                format!("DELETE FROM {steps} WHERE scope = $1 AND key = $2"),
                super::sql::params::KEY,
            ),
            forget_stale: format!(
                "DELETE FROM {steps} WHERE ctid = ANY(ARRAY(
                    SELECT ctid FROM {steps}
                    WHERE fingerprint IS NOT NULL AND recorded_at < now() - interval '1 day'
                    LIMIT 1000))"
            ),
            forget_orphans: format!(
                "DELETE FROM {steps} AS s WHERE NOT EXISTS (
                    SELECT 1 FROM {qualified} AS t
                    WHERE t.scope = s.scope AND t.key = s.key AND t.steps)"
            ),
            forget_function: format!("\"{schema}\".\"{table}_steps_forget\""),
            forget_on_update: format!("\"{table}_steps_forget_on_update\""),
            forget_on_delete: format!("\"{table}_steps_forget_on_delete\""),
            table: steps,
        }
    }
}

impl PostgresStore {
    /// The steps recorded under `lease`'s key, in order; `None`: the lease was lost.
    pub(super) async fn steps_of(
        &self,
        lease: &Lease,
    ) -> Result<Option<Vec<RecordedStep>>, StoreError> {
        let params: [&(dyn ToSql + Sync); 3] = [&lease.scope.as_str(), &&*lease.key, &lease.token];
        let client = self.running_client().await?;
        let reading =
            again_if_it_lost_a_race(|| self.query_on(&client, &self.sql.steps.read, &params));
        let rows = client.answer(reading).await;
        client.done(&rows);
        let rows = rows?;
        if rows.is_empty() {
            return Ok(None);
        }
        // A claim without steps: one row, of NULLs.
        let recorded = rows.iter().filter(|row| row.int4(0).is_some());
        recorded.map(step).collect::<Result<_, _>>().map(Some)
    }

    /// Records `step` under `lease`, if it still holds the key.
    pub(super) async fn record_step_held(
        &self,
        lease: &Lease,
        step: &RecordedStep,
    ) -> Result<Fenced, StoreError> {
        let n = place(step)?;
        let params: [&(dyn ToSql + Sync); 6] = [
            &lease.scope.as_str(),
            &&*lease.key,
            &lease.token,
            &n,
            &step.name.as_str(),
            &&*step.result,
        ];
        let client = self.running_client().await?;
        let recording =
            again_if_it_lost_a_race(|| self.query_on(&client, &self.sql.steps.record, &params));
        let rows = client.answer(recording).await;
        client.done(&rows);
        Ok(Fenced::kept_if(rows?.len() == 1))
    }

    /// The steps recorded for the request of `fingerprint` under the key of a claim in
    /// a transaction, read apart from it.
    pub(crate) async fn steps_apart(
        &self,
        lease: &Lease,
        fingerprint: &Fingerprint,
    ) -> Result<Vec<RecordedStep>, StoreError> {
        let fp: &[u8] = fingerprint.as_bytes();
        let params: [&(dyn ToSql + Sync); 3] = [&lease.scope.as_str(), &&*lease.key, &fp];
        let client = self.running_client().await?;
        let reading =
            again_if_it_lost_a_race(|| self.query_on(&client, &self.sql.steps.read_apart, &params));
        let rows = client.answer(reading).await;
        client.done(&rows);
        rows?.iter().map(step).collect()
    }

    /// Records `step` apart from the claim's transaction of `backend`, while that
    /// transaction runs.
    pub(crate) async fn record_step_apart(
        &self,
        lease: &Lease,
        backend: &Backend,
        fingerprint: &Fingerprint,
        step: &RecordedStep,
    ) -> Result<Fenced, StoreError> {
        let n = place(step)?;
        let fp: &[u8] = fingerprint.as_bytes();
        let params: [&(dyn ToSql + Sync); 9] = [
            &lease.scope.as_str(),
            &&*lease.key,
            &lease.token,
            &n,
            &step.name.as_str(),
            &&*step.result,
            &fp,
            &backend.pid,
            &backend.started,
        ];
        let client = self.running_client().await?;
        let recording = again_if_it_lost_a_race(|| {
            self.query_on(&client, &self.sql.steps.record_apart, &params)
        });
        let rows = client.answer(recording).await;
        client.done(&rows);
        Ok(Fenced::kept_if(rows?.len() == 1))
    }

    /// Forgets the steps of `lease`'s key on `client`, in the claim's transaction.
    pub(crate) async fn forget_steps_on(
        &self,
        client: &ClientWrapper,
        lease: &Lease,
    ) -> Result<(), StoreError> {
        let params: [&(dyn ToSql + Sync); 2] = [&lease.scope.as_str(), &&*lease.key];
        self.execute_on(client, &self.sql.steps.forget, &params)
            .await?;
        Ok(())
    }
}

impl PostgresStore {
    /// Records the request of a resumable key under `lease`, if it still holds the key:
    /// the step of place -1, named as registered.
    pub(super) async fn record_request_held(
        &self,
        lease: &Lease,
        name: &str,
        request: &bytes::Bytes,
    ) -> Result<Fenced, StoreError> {
        let params: [&(dyn ToSql + Sync); 6] = [
            &lease.scope.as_str(),
            &&*lease.key,
            &lease.token,
            &-1i32,
            &name,
            &&**request,
        ];
        let client = self.running_client().await?;
        let recording =
            again_if_it_lost_a_race(|| self.query_on(&client, &self.sql.steps.record, &params));
        let rows = client.answer(recording).await;
        client.done(&rows);
        Ok(Fenced::kept_if(rows?.len() == 1))
    }

    /// The resumable keys registered as `name` whose holder is gone.
    pub(super) async fn orphans_of(
        &self,
        name: &str,
        limit: usize,
    ) -> Result<Vec<Orphan>, StoreError> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let params: [&(dyn ToSql + Sync); 2] = [&name, &limit];
        let rows = self.query_pooled(&self.sql.steps.orphans, &params).await?;
        rows.iter().map(orphan).collect()
    }
}

/// A row of `scope, key, fingerprint, request` (`orphans`) as a resumable key whose
/// holder is gone.
pub(super) fn orphan(row: &impl Columns) -> Result<Orphan, StoreError> {
    let fingerprint = Fingerprint::from_slice(need(row.bytes(2), 2)?)
        .ok_or_else(|| corrupt("fingerprint is not 32 bytes"))?;
    Ok(Orphan {
        scope: Scope::new(need(row.text(0), 0)?),
        key: need(row.text(1), 1)?.to_owned(),
        fingerprint,
        request: bytes::Bytes::copy_from_slice(need(row.bytes(3), 3)?),
    })
}

/// A step's place, as the table keeps it.
pub(super) fn place(step: &RecordedStep) -> Result<i32, StoreError> {
    i32::try_from(step.n).map_err(|_| StoreError::new(StoreErrorKind::Other, "too many steps"))
}

/// A row of `n, name, result` as a step.
pub(super) fn step(row: &impl Columns) -> Result<RecordedStep, StoreError> {
    let n =
        u32::try_from(need(row.int4(0), 0)?).map_err(|_| corrupt("a step's place is negative"))?;
    Ok(RecordedStep {
        n,
        name: need(row.text(1), 1)?.to_owned(),
        result: bytes::Bytes::copy_from_slice(need(row.bytes(2), 2)?),
    })
}
