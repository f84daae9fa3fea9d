//! Generations: a table partitioned by `generation`, whose expired rows go a partition
//! at a time (`PostgresStore::with_generations`).
//!
//! New keys go to the newest generation. A claim that finds no row for its key
//! inserts it through a function that first takes a transaction-scoped advisory lock
//! of the key and looks again in every generation, in a statement of its own: the
//! primary key is `(scope, key, generation)`, unique within one partition only, and
//! the lock is what keeps a key to one row across them. Every other statement
//! addresses `(scope, key)` on the parent table, as on a plain one.
//!
//! The background purge rotates instead of deleting: every `period` it starts a new
//! generation, and it empties (`TRUNCATE`) an older one once none of its rows is live
//! (unexpired, or running under a live lease), checked again under a lock of its
//! partition that no writer can slip past; an emptied partition is then detached
//! (`DETACH PARTITION … CONCURRENTLY`, which does not hold up the claims) and dropped.

use std::time::Duration;

use deadpool_postgres::Pool;
use tokio_postgres::types::Type;

use super::{Checkout, errors::describe, tls::Connector};
use crate::store::{StoreError, StoreErrorKind};

/// The partitioned table, made instead of 0001's when it does not exist yet.
const CREATE: &str = include_str!("../../../migrations/generations/create.sql");

/// The functions of a table in generations, in order, each with the version
/// `<table>_migrations` records once it is applied, after the numbered migrations,
/// whose versions stay below them (`migrate::scripts`): the functions themselves, then
/// the claim's insert that names its holder (migration 0004's, for generations), then
/// the rotation that keeps remembered keys (`remember_keys_for`).
pub(super) const VERSIONS: &[(i32, &str)] = &[
    (
        1001,
        include_str!("../../../migrations/generations/generations.sql"),
    ),
    (
        1002,
        include_str!("../../../migrations/generations/holder.sql"),
    ),
    (
        1003,
        include_str!("../../../migrations/generations/remembered.sql"),
    ),
];

/// How long emptying a generation waits for the lock of its partition (claims and
/// completions queue behind that wait); past it, the next round tries again.
const EMPTY_LOCK_TIMEOUT: Duration = Duration::from_millis(50);

/// How many generations one round empties at most (one per statement).
const EMPTIED_PER_ROUND: usize = 8;

/// The names a table in generations adds, quoted where they are identifiers.
#[derive(Clone)]
pub(super) struct Names {
    schema: String,
    table: String,
    /// The parent table, schema-qualified.
    qualified: String,
    /// `<table>_generations`.
    generations: String,
    lock_key_function: String,
    pub(super) insert_completed_function: String,
    rotate_function: String,
    running_index: String,
}

impl Names {
    pub(super) fn new(schema: &str, table: &str) -> Self {
        Self {
            schema: schema.to_owned(),
            table: table.to_owned(),
            qualified: format!("\"{schema}\".\"{table}\""),
            generations: format!("\"{schema}\".\"{table}_generations\""),
            lock_key_function: format!("\"{schema}\".\"{table}_lock_key\""),
            insert_completed_function: format!("\"{schema}\".\"{table}_insert_completed\""),
            rotate_function: format!("\"{schema}\".\"{table}_rotate\""),
            running_index: format!("\"{table}_running\""),
        }
    }

    /// The partition of generation `g`.
    fn partition(&self, g: i64) -> String {
        format!("\"{}\".\"{}_g{g}\"", self.schema, self.table)
    }

    /// `sql` with this table's names in place of its `{{…}}` (the names are validated:
    /// `a-z`, `0-9`, `_`, so they need no escaping inside a string literal either).
    pub(super) fn render(&self, sql: &str) -> String {
        sql.replace("{{generations}}", &self.generations)
            .replace("{{first_partition}}", &self.partition(1))
            .replace("{{lock_key_function}}", &self.lock_key_function)
            .replace(
                "{{insert_completed_function}}",
                &self.insert_completed_function,
            )
            .replace("{{rotate_function}}", &self.rotate_function)
            .replace("{{running_index}}", &self.running_index)
            .replace("{{schema_literal}}", &format!("'{}'", self.schema))
            .replace("{{table_literal}}", &format!("'{}'", self.table))
    }

    /// The emptied generations, and whether each one's partition is still attached
    /// (`Some(pending)`: attached, and whether a detach of it is under way) or gone
    /// from the parent (`None`).
    fn emptied_statement(&self) -> String {
        format!(
            "SELECT g.generation, i.inhdetachpending
             FROM {gens} AS g
             LEFT JOIN pg_inherits AS i
               ON i.inhparent = to_regclass($1)
              AND i.inhrelid = to_regclass(format('%I.%I', $2::text, $3::text || '_g' || g.generation))
             WHERE g.emptied_at IS NOT NULL
             ORDER BY g.generation",
            gens = self.generations
        )
    }
}

/// What one rotation of a table's generations did
/// ([`PostgresStore::rotate_generations`](super::PostgresStore::rotate_generations)).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct GenerationRotation {
    /// The generation started, if the newest was a period old.
    pub started: Option<i64>,
    /// The generations emptied: none of their rows was live (unexpired, or running
    /// under a live lease).
    pub emptied: Vec<i64>,
    /// The generations whose emptied partition was detached and dropped.
    pub dropped: Vec<i64>,
}

/// The rotation of one store's table: its names and its period.
pub(super) struct Rotator {
    pub(super) period: Duration,
    names: Names,
    /// How long a completed key is remembered once its response expired: a
    /// generation is emptied only once its rows are all forgotten.
    remember: Duration,
    /// With keys remembered: the batch that reduces the completed rows whose response
    /// expired to remembered ones, run before each rotation (`Sql::reduce_in_turn`),
    /// so that no response outlives its TTL here either.
    pub(super) reduce: Option<super::sql::Statement>,
    /// Forgets the recorded steps of keys whose rows went with a generation emptied
    /// (a `TRUNCATE` fires no trigger).
    forget_orphan_steps: String,
}

impl Rotator {
    pub(super) fn new(
        period: Duration,
        names: Names,
        sql: &super::sql::Sql,
        forget_orphan_steps: String,
    ) -> Self {
        Self {
            period,
            names,
            remember: sql.remember,
            reduce: (!sql.remember.is_zero()).then(|| sql.reduce_in_turn.clone()),
            forget_orphan_steps,
        }
    }

    /// One round: a new generation if one is due, then every generation that can be
    /// emptied, up to `EMPTIED_PER_ROUND`; then the emptied ones detached and dropped.
    /// `lock`: the table's purge lock, so that replicas rotate in turn.
    pub(super) async fn round(
        &self,
        pool: &Pool,
        connector: Option<&Connector>,
        lock: i64,
    ) -> Result<GenerationRotation, String> {
        let mut rotation = GenerationRotation::default();
        for step in 0..EMPTIED_PER_ROUND {
            // One generation started per round at most.
            let period = (step == 0).then(|| super::ms(self.period));
            let (started, emptied) = self.step(pool, connector, lock, period).await?;
            rotation.started = rotation.started.or(started);
            match emptied {
                Some(g) => rotation.emptied.push(g),
                None => break,
            }
        }
        if !rotation.emptied.is_empty() {
            let conn = checkout(pool, connector).await?;
            conn.batch_execute(&self.forget_orphan_steps)
                .await
                .map_err(|e| describe(&e))?;
            conn.done();
        }
        rotation.dropped = self.drop_emptied(pool, connector).await?;
        Ok(rotation)
    }

    /// One statement of the rotation: (started, emptied). With no `period`, it starts
    /// no generation. In a read committed transaction of its own whatever the
    /// database's default (its DDL and its checks must see what is committed), sent
    /// as one simple query: its parameters are numbers, written into the text.
    async fn step(
        &self,
        pool: &Pool,
        connector: Option<&Connector>,
        lock: i64,
        period: Option<i64>,
    ) -> Result<(Option<i64>, Option<i64>), String> {
        let conn = checkout(pool, connector).await?;
        let period = period.map_or("NULL".to_owned(), |p| p.to_string());
        let timeout = super::ms(EMPTY_LOCK_TIMEOUT);
        let remember = super::ms(self.remember);
        let sql = format!(
            "BEGIN ISOLATION LEVEL READ COMMITTED;
             SELECT started, emptied FROM {}({period}, {lock}, {timeout}, {remember});
             COMMIT",
            self.names.rotate_function
        );
        let answer = conn.simple_query(&sql).await;
        let answer = match answer {
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
        answer
            .iter()
            .find_map(|m| match m {
                tokio_postgres::SimpleQueryMessage::Row(row) => {
                    Some((number(row, 0), number(row, 1)))
                }
                _ => None,
            })
            .ok_or_else(|| "the rotation returned no row".to_owned())
    }

    /// Detaches and drops the emptied partitions: `DETACH PARTITION … CONCURRENTLY`
    /// waits for the transactions that may still read them, without locking the
    /// claims out; one interrupted midway (its connection lost, given up on) is
    /// finished with `FINALIZE`. Each statement on its own, outside any transaction,
    /// as `CONCURRENTLY` requires, and unnamed (they are rare, and run behind a
    /// transaction pooler too). Returns the generations dropped.
    async fn drop_emptied(
        &self,
        pool: &Pool,
        connector: Option<&Connector>,
    ) -> Result<Vec<i64>, String> {
        let conn = checkout(pool, connector).await?;
        let err = |e: tokio_postgres::Error| describe(&e);
        let rows = conn
            .query_typed(
                &self.names.emptied_statement(),
                &[
                    (&self.names.qualified, Type::TEXT),
                    (&self.names.schema, Type::TEXT),
                    (&self.names.table, Type::TEXT),
                ],
            )
            .await
            .map_err(err)?;
        let mut dropped = Vec::new();
        let parent = &self.names.qualified;
        for row in rows {
            let g: i64 = row.get(0);
            let pending: Option<bool> = row.get(1);
            let partition = self.names.partition(g);
            let detach = match pending {
                Some(false) => Some("CONCURRENTLY"),
                Some(true) => Some("FINALIZE"),
                None => None,
            };
            if let Some(how) = detach {
                conn.batch_execute(&format!(
                    "ALTER TABLE {parent} DETACH PARTITION {partition} {how}"
                ))
                .await
                .map_err(err)?;
            }
            conn.batch_execute(&format!("DROP TABLE IF EXISTS {partition}"))
                .await
                .map_err(err)?;
            conn.execute_typed(
                &format!(
                    "DELETE FROM {} WHERE generation = $1",
                    self.names.generations
                ),
                &[(&g, Type::INT8)],
            )
            .await
            .map_err(err)?;
            dropped.push(g);
        }
        conn.done();
        Ok(dropped)
    }
}

/// A pooled connection, closed (its statement cancelled) if dropped before it is done.
async fn checkout(pool: &Pool, connector: Option<&Connector>) -> Result<Checkout, String> {
    let client = pool.get().await.map_err(|e| e.to_string())?;
    Ok(Checkout(Some(client), connector.cloned()))
}

/// The statements that create the table in generations, with `names` in place.
pub(super) fn create_sql(names: &Names) -> String {
    names
        .render(&super::migrate::without_notes(CREATE))
        .replace("{{table}}", &names.qualified)
}

/// In the migration's transaction, before the numbered migrations: creates the table
/// in generations if it does not exist yet; refuses a plain table of that name, which
/// cannot be turned into a partitioned one in place (docs/postgres.md says how to move
/// it). `failed`: how a failed statement is reported.
pub(super) async fn create_if_absent(
    tx: &impl deadpool_postgres::GenericClient,
    names: &Names,
    failed: impl Fn(tokio_postgres::Error) -> StoreError,
) -> Result<(), StoreError> {
    let kind: Option<String> = tx
        .query_opt(
            "SELECT relkind::text FROM pg_class WHERE oid = to_regclass($1)",
            &[&names.qualified],
        )
        .await
        .map_err(&failed)?
        .map(|row| row.get(0));
    match kind.as_deref() {
        None => tx.batch_execute(&create_sql(names)).await.map_err(failed),
        Some("p") => Ok(()),
        Some(_) => Err(StoreError::new(
            StoreErrorKind::Misconfigured,
            format!(
                "{} is a plain table, and the store is built with generations, which need it partitioned: move it to a table in generations (docs/postgres.md), or build the store without them",
                names.qualified
            ),
        )),
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
