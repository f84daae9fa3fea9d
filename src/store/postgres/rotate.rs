//! The rotation of a table in generations on tokio-postgres: the statements of
//! `generations` run on the store's pool ([`RunsRotation`]), and the table created
//! in the migration's transaction (`create_if_absent`).

use std::time::Duration;

use deadpool_postgres::Pool;
use tokio_postgres::types::Type;

use super::{
    Checkout,
    errors::describe,
    generations::{
        EmptiedRow, GenerationRotation, Names, RELATION_KIND, RunsRotation, StepRow, to_create,
    },
    tls::Connector,
};
use crate::store::{BoxFuture, StoreError, StoreErrorKind};

/// The store's pool, and the TLS of the cancel request for a statement given up on.
pub(super) struct OnPool<'a> {
    pub(super) pool: &'a Pool,
    pub(super) connector: Option<&'a Connector>,
}

impl OnPool<'_> {
    /// A pooled connection, closed (its statement cancelled) if dropped before it is done.
    async fn checkout(&self) -> Result<Checkout, String> {
        let client = self.pool.get().await.map_err(|e| e.to_string())?;
        Ok(Checkout(Some(client), self.connector.cloned()))
    }
}

impl RunsRotation for OnPool<'_> {
    fn step<'a>(&'a self, sql: &'a str) -> BoxFuture<'a, Result<Option<StepRow>, String>> {
        Box::pin(async move {
            let conn = self.checkout().await?;
            let answer = match conn.simple_query(sql).await {
                Ok(answer) => {
                    conn.done();
                    answer
                }
                // Rolled back, the connection clean again, or closed if that fails too.
                Err(e) => {
                    super::tx::roll_back_or_close(conn, Duration::from_secs(5)).await;
                    return Err(describe(&e));
                }
            };
            let number = |row: &tokio_postgres::SimpleQueryRow, i| -> Option<i64> {
                row.get(i).and_then(|v: &str| v.parse().ok())
            };
            Ok(answer.iter().find_map(|m| match m {
                tokio_postgres::SimpleQueryMessage::Row(row) => {
                    Some((number(row, 0), number(row, 1)))
                }
                _ => None,
            }))
        })
    }

    fn batch<'a>(&'a self, sql: &'a str) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            let conn = self.checkout().await?;
            conn.batch_execute(sql).await.map_err(|e| describe(&e))?;
            conn.done();
            Ok(())
        })
    }

    fn emptied<'a>(
        &'a self,
        sql: &'a str,
        params: [&'a str; 3],
    ) -> BoxFuture<'a, Result<Vec<EmptiedRow>, String>> {
        Box::pin(async move {
            let conn = self.checkout().await?;
            let [a, b, c] = params;
            let rows = conn
                .query_typed(sql, &[(&a, Type::TEXT), (&b, Type::TEXT), (&c, Type::TEXT)])
                .await
                .map_err(|e| describe(&e))?;
            conn.done();
            Ok(rows.iter().map(|row| (row.get(0), row.get(1))).collect())
        })
    }
}

/// In the migration's transaction, before the numbered migrations: creates the table
/// in generations if it does not exist yet, or refuses a plain one (`to_create`).
/// `failed`: how a failed statement is reported.
pub(super) async fn create_if_absent(
    tx: &impl deadpool_postgres::GenericClient,
    names: &Names,
    failed: impl Fn(tokio_postgres::Error) -> StoreError,
) -> Result<(), StoreError> {
    let kind: Option<String> = tx
        .query_opt(RELATION_KIND, &[&names.qualified])
        .await
        .map_err(&failed)?
        .map(|row| row.get(0));
    match to_create(names, kind.as_deref())? {
        Some(sql) => tx.batch_execute(&sql).await.map_err(failed),
        None => Ok(()),
    }
}

impl super::PostgresStore {
    /// Rotates the table's generations once, as the background purge does at its
    /// period: for a store whose background purge is off, from a scheduled job. Replicas
    /// take turns (a rotation that finds another under way does nothing). Without
    /// generations, it does nothing.
    pub async fn rotate_generations(&self) -> Result<GenerationRotation, StoreError> {
        self.purge
            .rotate()
            .await
            .map_err(|e| StoreError::new(StoreErrorKind::Unavailable, e))
    }

    /// See [`create_if_absent`].
    pub(super) async fn create_generations_if_absent(
        &self,
        tx: &impl deadpool_postgres::GenericClient,
        failed: impl Fn(tokio_postgres::Error) -> StoreError,
    ) -> Result<(), StoreError> {
        match &self.sql.generations {
            Some(names) => create_if_absent(tx, names, failed).await,
            None => Ok(()),
        }
    }
}
