//! Tables in generations on the sqlx driver (`SqlxStore::with_generations`): the
//! statements of `store/postgres/generations` run on the app's pool. Their text, the
//! names and what a rotation decides are the PostgreSQL store's (`Rotator`); this
//! module only runs them.

use std::{sync::Arc, time::Duration};

use ::sqlx::{Executor as _, PgConnection, PgPool, Row as _, postgres::PgRow};

use super::{
    super::{
        generations::{
            EmptiedRow, GenerationRotation, RELATION_KIND, Rotator, RunsRotation, StepRow,
            to_create,
        },
        purge,
    },
    SqlxStore,
};
use crate::store::{BoxFuture, StoreError, StoreErrorKind};

/// Rows reduced per statement before a rotation, when keys are remembered.
const REDUCE_BATCH: i64 = 1000;

/// How long a rotation may take before it is given up on (one interrupted midway is
/// finished in a later round), as on tokio-postgres.
const ROUND_BOUND: Duration = Duration::from_secs(30);

/// The rotation of `sql`'s table, if the store keeps it in generations of `period`.
pub(super) fn rotator(
    period: Option<Duration>,
    sql: &super::super::sql::Sql,
) -> Option<Arc<Rotator>> {
    let (period, names) = period.zip(sql.generations.clone())?;
    let orphans = sql.steps.forget_orphans.clone();
    Some(Arc::new(Rotator::new(period, names, sql, orphans)))
}

/// The app's pool, running a rotation's statements.
struct OnPool<'a>(&'a PgPool);

impl RunsRotation for OnPool<'_> {
    fn step<'a>(&'a self, sql: &'a str) -> BoxFuture<'a, Result<Option<StepRow>, String>> {
        Box::pin(async move {
            let mut conn = self.0.acquire().await.map_err(|e| e.to_string())?;
            match conn.fetch_all(::sqlx::raw_sql(sql)).await {
                Ok(rows) => Ok(rows.first().map(|row| (number(row, 0), number(row, 1)))),
                // Rolled back, the connection clean again, or closed if that fails too.
                Err(e) => {
                    if conn.execute(::sqlx::raw_sql("ROLLBACK")).await.is_err() {
                        conn.close_on_drop();
                    }
                    Err(e.to_string())
                }
            }
        })
    }

    fn batch<'a>(&'a self, sql: &'a str) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            self.0
                .execute(::sqlx::raw_sql(sql))
                .await
                .map(drop)
                .map_err(|e| e.to_string())
        })
    }

    fn emptied<'a>(
        &'a self,
        sql: &'a str,
        [a, b, c]: [&'a str; 3],
    ) -> BoxFuture<'a, Result<Vec<EmptiedRow>, String>> {
        Box::pin(async move {
            // In a transaction of its own: behind a transaction pooler, the unnamed
            // statement's parse and execution would otherwise reach two sessions.
            let mut tx = self.0.begin().await.map_err(|e| e.to_string())?;
            let rows = ::sqlx::query(sql)
                .persistent(false)
                .bind(a)
                .bind(b)
                .bind(c)
                .fetch_all(&mut *tx)
                .await
                .map_err(|e| e.to_string())?;
            tx.commit().await.map_err(|e| e.to_string())?;
            rows.iter()
                .map(|row| Ok((row.try_get(0)?, row.try_get(1)?)))
                .collect::<Result<_, ::sqlx::Error>>()
                .map_err(|e| e.to_string())
        })
    }
}

/// A number of a step's row (sent as text by the simple query, which sqlx decodes).
fn number(row: &PgRow, i: usize) -> Option<i64> {
    row.try_get::<Option<i64>, _>(i).ok().flatten()
}

impl SqlxStore {
    /// Keeps the table in generations of `period`, as
    /// [`PostgresStore::with_generations`](crate::store::PostgresStore::with_generations)
    /// does (the same table, functions and rotation; a table in generations may be
    /// served by both stores at once, each built with generations): its expired rows go
    /// a generation at a time instead of row by row. The background purge
    /// ([`with_background_purge`](Self::with_background_purge)) rotates instead of
    /// deleting; [`rotate_generations`](Self::rotate_generations) rotates on demand.
    /// [`migrate`](Self::migrate) creates the partitioned table when it does not exist
    /// yet, and refuses a plain table of that name.
    ///
    /// ```no_run
    /// use std::time::Duration;
    /// use sqlx::postgres::PgPoolOptions;
    /// use tower_idempotency::store::SqlxStore;
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let pool = PgPoolOptions::new().connect("postgres://app@db/app").await?;
    /// let store = SqlxStore::new(pool).with_generations(Duration::from_secs(24 * 60 * 60));
    /// store.migrate().await?;
    /// # Ok(()) }
    /// ```
    #[must_use]
    pub fn with_generations(self, period: Duration) -> Self {
        self.rebuilt(|s| s.generations = Some(period.min(crate::settings::TEN_YEARS)))
    }

    /// Rotates the table's generations once, as the background purge does at its
    /// period, as
    /// [`PostgresStore::rotate_generations`](crate::store::PostgresStore::rotate_generations):
    /// replicas take turns (a rotation that finds another under way does nothing).
    /// Without generations, it does nothing.
    ///
    /// # Errors
    ///
    /// [`Unavailable`](StoreErrorKind::Unavailable) when a statement of the rotation
    /// failed or it took longer than 30 s; the next rotation takes up where it stopped.
    pub async fn rotate_generations(&self) -> Result<GenerationRotation, StoreError> {
        let Some(rotator) = &self.rotator else {
            return Ok(GenerationRotation::default());
        };
        let unavailable = |e: String| StoreError::new(StoreErrorKind::Unavailable, e);
        let lock = purge::lock_id(&self.sql.qualified);
        // Responses past their TTL dropped first, their keys remembered.
        if let Some(reduce) = &rotator.reduce {
            loop {
                // Behind a transaction pooler, in a transaction of its own (`execute`).
                let reduced = self
                    .execute(
                        ::sqlx::query(reduce)
                            .persistent(self.persistent)
                            .bind(REDUCE_BATCH)
                            .bind(lock),
                    )
                    .await?;
                if reduced < REDUCE_BATCH as u64 {
                    break;
                }
            }
        }
        tokio::time::timeout(ROUND_BOUND, rotator.round(&OnPool(&self.pool), lock))
            .await
            .unwrap_or_else(|_| Err("a rotation took longer than 30 s; given up".to_owned()))
            .map_err(unavailable)
    }

    /// In the migration's transaction, before the numbered migrations: creates the
    /// table in generations if it does not exist yet, or refuses a plain one
    /// (`generations::to_create`). Without generations, it does nothing.
    pub(super) async fn create_generations_if_absent(
        &self,
        tx: &mut PgConnection,
    ) -> Result<(), StoreError> {
        let Some(names) = &self.sql.generations else {
            return Ok(());
        };
        let failed = |e: ::sqlx::Error| super::classify_with(e, |_| None);
        let kind: Option<String> = ::sqlx::query_scalar(RELATION_KIND)
            .persistent(self.persistent)
            .bind(&names.qualified)
            .fetch_optional(&mut *tx)
            .await
            .map_err(failed)?;
        match to_create(names, kind.as_deref())? {
            Some(sql) => tx
                .execute(::sqlx::raw_sql(&sql))
                .await
                .map(drop)
                .map_err(failed),
            None => Ok(()),
        }
    }
}
