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
//!
//! This module is what both drivers share: the names, the statements' text and what a
//! round decides ([`Rotator`]). A driver only runs the statements ([`RunsRotation`]):
//! `rotate` for tokio-postgres, `store/sqlx/generations` for sqlx.

use std::time::Duration;

use crate::store::{BoxFuture, StoreError, StoreErrorKind};

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
    pub(super) qualified: String,
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

/// How a driver runs the rotation's statements (`rotate` for tokio-postgres,
/// `store/sqlx/generations` for sqlx): the statements and what a round decides are
/// [`Rotator`]'s. Errors are described as text, as the purge reports them.
pub(crate) trait RunsRotation: Send + Sync {
    /// Runs one step of the rotation ([`Rotator::step_sql`]: a transaction of its own,
    /// sent as one simple query) on a connection that goes back to the pool clean
    /// (rolled back, or closed) whatever happens; returns its row's two numbers, or
    /// `None` if it returned no row.
    fn step<'a>(&'a self, sql: &'a str) -> BoxFuture<'a, Result<Option<StepRow>, String>>;
    /// Runs `sql`, statements without parameters, outside any transaction.
    fn batch<'a>(&'a self, sql: &'a str) -> BoxFuture<'a, Result<(), String>>;
    /// The rows of [`Names::emptied_statement`] with its three text parameters.
    fn emptied<'a>(
        &'a self,
        sql: &'a str,
        params: [&'a str; 3],
    ) -> BoxFuture<'a, Result<Vec<EmptiedRow>, String>>;
}

/// A step's row: the generation started, the generation emptied.
pub(crate) type StepRow = (Option<i64>, Option<i64>);

/// A row of `emptied_statement`: an emptied generation, and whether its partition is
/// attached and a detach of it under way (`None`: detached).
pub(crate) type EmptiedRow = (i64, Option<bool>);

/// The rotation of one store's table: its names and its period.
pub(super) struct Rotator {
    pub(super) period: Duration,
    pub(super) names: Names,
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
        runs: &impl RunsRotation,
        lock: i64,
    ) -> Result<GenerationRotation, String> {
        let mut rotation = GenerationRotation::default();
        for step in 0..EMPTIED_PER_ROUND {
            // One generation started per round at most.
            let period = (step == 0).then(|| super::ms(self.period));
            let (started, emptied) = runs
                .step(&self.step_sql(lock, period))
                .await?
                .ok_or_else(|| "the rotation returned no row".to_owned())?;
            rotation.started = rotation.started.or(started);
            match emptied {
                Some(g) => rotation.emptied.push(g),
                None => break,
            }
        }
        if !rotation.emptied.is_empty() {
            runs.batch(&self.forget_orphan_steps).await?;
        }
        rotation.dropped = self.drop_emptied(runs).await?;
        Ok(rotation)
    }

    /// One statement of the rotation, which returns (started, emptied). With no
    /// `period`, it starts no generation. In a read committed transaction of its own
    /// whatever the database's default (its DDL and its checks must see what is
    /// committed), sent as one simple query: its parameters are numbers, written into
    /// the text.
    fn step_sql(&self, lock: i64, period: Option<i64>) -> String {
        let period = period.map_or("NULL".to_owned(), |p| p.to_string());
        let timeout = super::ms(EMPTY_LOCK_TIMEOUT);
        let remember = super::ms(self.remember);
        format!(
            "BEGIN ISOLATION LEVEL READ COMMITTED;
             SELECT started, emptied FROM {}({period}, {lock}, {timeout}, {remember});
             COMMIT",
            self.names.rotate_function
        )
    }

    /// Detaches and drops the emptied partitions: `DETACH PARTITION … CONCURRENTLY`
    /// waits for the transactions that may still read them, without locking the
    /// claims out; one interrupted midway (its connection lost, given up on) is
    /// finished with `FINALIZE`. Each statement on its own, outside any transaction,
    /// as `CONCURRENTLY` requires, and unnamed (they are rare, and run behind a
    /// transaction pooler too). Returns the generations dropped.
    async fn drop_emptied(&self, runs: &impl RunsRotation) -> Result<Vec<i64>, String> {
        let names = &self.names;
        let rows = runs
            .emptied(
                &names.emptied_statement(),
                [&names.qualified, &names.schema, &names.table],
            )
            .await?;
        let mut dropped = Vec::new();
        for (g, pending) in rows {
            for statement in names.drop_statements(g, pending) {
                runs.batch(&statement).await?;
            }
            dropped.push(g);
        }
        Ok(dropped)
    }
}

impl Names {
    /// What drops emptied generation `g`, in order: its partition detached if it is
    /// still attached (`pending`: see `emptied_statement`), `FINALIZE`d if a detach of
    /// it was interrupted; the partition dropped; the generation forgotten.
    fn drop_statements(&self, g: i64, pending: Option<bool>) -> Vec<String> {
        let parent = &self.qualified;
        let partition = self.partition(g);
        let detach = match pending {
            Some(false) => Some("CONCURRENTLY"),
            Some(true) => Some("FINALIZE"),
            None => None,
        };
        detach
            .map(|how| format!("ALTER TABLE {parent} DETACH PARTITION {partition} {how}"))
            .into_iter()
            .chain([
                format!("DROP TABLE IF EXISTS {partition}"),
                format!("DELETE FROM {} WHERE generation = {g}", self.generations),
            ])
            .collect()
    }
}

/// The statements that create the table in generations, with `names` in place.
pub(super) fn create_sql(names: &Names) -> String {
    names
        .render(&super::migrate::without_notes(CREATE))
        .replace("{{table}}", &names.qualified)
}

/// The kind of the relation of the table's name (`pg_class.relkind`), if there is one;
/// its parameter is [`Names::qualified`].
pub(super) const RELATION_KIND: &str =
    "SELECT relkind::text FROM pg_class WHERE oid = to_regclass($1)";

/// What the migration's transaction does, before the numbered migrations, given the
/// kind of the relation of the table's name (`RELATION_KIND`): creates the table in
/// generations if it does not exist yet (the statements returned); refuses a plain
/// table of that name, which cannot be turned into a partitioned one in place
/// (docs/postgres.md says how to move it).
pub(super) fn to_create(names: &Names, kind: Option<&str>) -> Result<Option<String>, StoreError> {
    match kind {
        None => Ok(Some(create_sql(names))),
        Some("p") => Ok(None),
        Some(_) => Err(StoreError::new(
            StoreErrorKind::Misconfigured,
            format!(
                "{} is a plain table, and the store is built with generations, which need it partitioned: move it to a table in generations (docs/postgres.md), or build the store without them",
                names.qualified
            ),
        )),
    }
}
