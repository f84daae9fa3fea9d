//! Recorded steps (migration 0006): a running claim's steps read, and one recorded,
//! fenced by the claim's token, each in one statement on a running claim's connection
//! (`running_client`: a reserve connection is set up as the app says).

use tokio_postgres::types::{ToSql, Type};

use super::{
    PostgresStore,
    errors::{again_if_it_lost_a_race, corrupt},
    sql::Statement,
};
use crate::store::{Fenced, Lease, RecordedStep, StoreError, StoreErrorKind};

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
    /// The steps whose key has no row marked as having them: left by a generation
    /// emptied whole (`TRUNCATE` fires no trigger).
    pub(super) forget_orphans: String,
}

impl Statements {
    pub(super) fn new(schema: &str, table: &str, qualified: &str) -> Self {
        let steps = format!("\"{schema}\".\"{table}_steps\"");
        Self {
            read: Statement::new(
                format!(
                    "SELECT s.n, s.name, s.result
                     FROM {qualified} AS t
                     LEFT JOIN {steps} AS s ON t.steps AND s.scope = t.scope AND s.key = t.key
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
        let mut steps = Vec::with_capacity(rows.len());
        for row in &rows {
            let Some(n) = row.get::<_, Option<i32>>(0) else {
                continue;
            };
            let n = u32::try_from(n).map_err(|_| corrupt("a step's place is negative"))?;
            let name: String = row.get(1);
            let result: Vec<u8> = row.get(2);
            steps.push(RecordedStep {
                n,
                name,
                result: result.into(),
            });
        }
        Ok(Some(steps))
    }

    /// Records `step` under `lease`, if it still holds the key.
    pub(super) async fn record_step_held(
        &self,
        lease: &Lease,
        step: &RecordedStep,
    ) -> Result<Fenced, StoreError> {
        let n = i32::try_from(step.n)
            .map_err(|_| StoreError::new(StoreErrorKind::Other, "too many steps"))?;
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
}
