//! Migrations: the schema, the table and its functions, created and brought up to date
//! under an advisory lock, in one read committed transaction, from `migrations/`; and
//! the same migrations as SQL, for a team that applies them with its own tool.

use std::{borrow::Cow, fmt::Write as _, time::Duration};

use tokio_postgres::error::SqlState;

use super::{PostgresStore, checkout::pooled, errors::classify_with, generations, sql::Sql};
use crate::store::{StoreError, StoreErrorKind};

/// The migrations, in order, embedded from `migrations/`.
pub(super) const MIGRATIONS: &[(i32, &str)] = &[
    (
        1,
        include_str!("../../../migrations/0001_create_idempotency_keys.sql"),
    ),
    (2, include_str!("../../../migrations/0002_waiters.sql")),
    (3, include_str!("../../../migrations/0003_claim_insert.sql")),
    (4, include_str!("../../../migrations/0004_holders.sql")),
    (5, include_str!("../../../migrations/0005_steps.sql")),
];

/// An advisory lock id shared by every process migrating this crate's tables.
pub(super) const MIGRATION_LOCK: i64 = 0x7469_6465_6d70_6f74; // "tidempot"

/// How long a migration waits to lock the table, and how many times it tries (see
/// `migrate`).
pub(super) const MIGRATION_LOCK_TIMEOUT: Duration = Duration::from_secs(1);
pub(super) const MIGRATION_ATTEMPTS: u32 = 3;

/// Why an attempt to migrate failed.
pub(super) enum Failure {
    /// This migration could not lock the table within `MIGRATION_LOCK_TIMEOUT`.
    TableBusy(i32),
    Failed(StoreError),
}

impl From<StoreError> for Failure {
    fn from(e: StoreError) -> Self {
        Self::Failed(e)
    }
}

/// One migration of a store's table as SQL, for a team that applies migrations with its
/// own tool ([`PostgresStore::migrations`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Migration {
    /// Its version, as `<table>_migrations` records it.
    pub version: i32,
    /// Its statements, with the store's schema and table names in place, ending with
    /// the row that records it in `<table>_migrations`. The first migration's begin by
    /// creating the schema if it is missing, and `<table>_migrations`.
    pub sql: String,
}

/// What `migrate` was doing when a statement failed: it decides the hint of a
/// permission error.
#[derive(Clone, Copy)]
enum Step {
    /// Reading `<table>_migrations`, to find what is applied.
    Reading,
    /// Creating the schema, which is missing.
    CreatingSchema,
    /// Creating `<table>_migrations`, or applying a migration.
    Applying,
}

/// The migrations of `sql`'s table, with its names in place, in the order `migrate`
/// applies them: those of `migrations/`, then, for a table in generations, its
/// functions (`migrations/generations/`, `generations::VERSIONS`).
pub(super) fn scripts(sql: &Sql) -> Vec<(i32, String)> {
    let mut scripts: Vec<(i32, String)> = MIGRATIONS
        .iter()
        .map(|(version, text)| (*version, render(sql, text)))
        .collect();
    if sql.generations.is_some() {
        scripts.extend(
            generations::VERSIONS
                .iter()
                .map(|(version, text)| (*version, render(sql, text))),
        );
    }
    scripts
}

/// `text` with `sql`'s names in place of its `{{…}}`, without its notes on them.
pub(super) fn render(sql: &Sql, text: &str) -> String {
    let text = without_notes(text)
        .replace("{{table}}", &sql.qualified)
        .replace("{{expires_index}}", &sql.expires_index)
        .replace("{{claim_function}}", &sql.claim_function)
        .replace("{{holders}}", &sql.holders)
        .replace("{{holder_gone_function}}", &sql.holder_gone_function)
        .replace("{{steps}}", &sql.steps.table)
        .replace("{{steps_forget_function}}", &sql.steps.forget_function)
        .replace("{{steps_forget_on_update}}", &sql.steps.forget_on_update)
        .replace("{{steps_forget_on_delete}}", &sql.steps.forget_on_delete);
    match &sql.generations {
        Some(names) => names.render(&text),
        None => text,
    }
}

/// `text` without the comment lines that say what its `{{…}}` stand for (those that
/// begin `-- {{`), which would read as nonsense with the names in place.
pub(super) fn without_notes(text: &str) -> String {
    text.lines()
        .filter(|line| !line.trim_start().starts_with("-- {{"))
        .map(|line| format!("{line}\n"))
        .collect()
}

/// The statement that creates `sql`'s `<table>_migrations` where it does not exist.
pub(super) fn create_migrations_table(sql: &Sql) -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS {} (
    version integer PRIMARY KEY,
    applied_at timestamptz NOT NULL DEFAULT now());",
        sql.migrations_table
    )
}

impl PostgresStore {
    /// Creates the schema (if it is missing), the table and its functions, and applies
    /// pending migrations.
    ///
    /// Safe to run from several processes at once: migrations are serialised by a
    /// transaction-scoped advisory lock, in a read committed transaction whatever the
    /// database's default isolation and timeouts, and recorded in `<table>_migrations`.
    /// Once everything is applied it only reads that record, so a role that may not
    /// create objects can run it. Applying migrations needs `USAGE` and `CREATE` on the
    /// schema (and `CREATE` on the database only when the schema is missing), and to
    /// own the table to change it: docs/postgres.md lists the grants, for it and for the
    /// app. A team that migrates with its own tool applies [`migration_sql`](Self::migration_sql)
    /// instead, and checks the result at start-up with [`verify`](Self::verify).
    ///
    /// A migration that must lock the table waits at most 1 s for it (`lock_timeout`),
    /// well within the claims' store timeout, and is tried three times, a second or two
    /// apart; then it fails with a [`Timeout`](crate::store::StoreErrorKind::Timeout)
    /// that says so, and applies nothing. Waiting on behind a long transaction on the
    /// table, it would hold up every claim queued behind its lock request. Run it again
    /// when the table is quiet.
    ///
    /// # Errors
    ///
    /// A [`StoreError`] of kind [`Timeout`](crate::store::StoreErrorKind::Timeout) when the
    /// table stayed busy through every attempt, [`Misconfigured`](crate::store::StoreErrorKind::Misconfigured)
    /// when the role may not create what is missing (the error says which right it
    /// lacks), and [`Unavailable`](crate::store::StoreErrorKind::Unavailable)
    /// when the database cannot be reached. Nothing is half applied: each migration is
    /// one transaction.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        let mut attempt = 1;
        loop {
            match self.migrate_once().await {
                Err(Failure::TableBusy(version)) if attempt < MIGRATION_ATTEMPTS => {
                    tracing::warn!(
                        version,
                        table = %self.sql.qualified,
                        "a migration could not lock the table; trying again"
                    );
                    attempt += 1;
                    let wait = 1000 + crate::random::u64() % 1000;
                    tokio::time::sleep(Duration::from_millis(wait)).await;
                }
                Err(Failure::TableBusy(version)) => {
                    return Err(StoreError::new(
                        StoreErrorKind::Timeout,
                        format!(
                            "migration {version} could not lock {} within {} ms, {MIGRATION_ATTEMPTS} times: a long transaction holds the table; nothing was applied, run migrate() again when the table is quiet",
                            self.sql.qualified,
                            MIGRATION_LOCK_TIMEOUT.as_millis()
                        ),
                    ));
                }
                Err(Failure::Failed(e)) => return Err(e),
                Ok(()) => return Ok(()),
            }
        }
    }

    /// The store's migrations as SQL, one by one, in the order [`migrate`](Self::migrate)
    /// applies them, with the store's schema and table names (and its generations, if it
    /// has them) in place: for a team whose migration tool (sqlx, refinery, Flyway,
    /// plain `psql`) wants one file per migration. Each records itself in
    /// `<table>_migrations` as `migrate()` would, so that `migrate()` and
    /// [`verify`](Self::verify) agree with what the tool applied. When a new version of
    /// the crate brings a migration, `verify()` names the versions missing, and the
    /// migrations of those versions are the next file. Nothing connects.
    ///
    /// ```
    /// use tower_idempotency::store::PostgresStore;
    ///
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let store = PostgresStore::connect("postgres://app@db.internal/payments")?
    ///     .with_schema_name("billing")?;
    /// let migrations = store.migrations();
    /// assert_eq!(migrations[0].version, 1);
    /// assert!(migrations[0].sql.contains(r#"CREATE TABLE IF NOT EXISTS "billing"."idempotency_keys""#));
    /// assert!(migrations.iter().all(|m| m.sql.contains(r#"INSERT INTO "billing"."idempotency_keys_migrations""#)));
    /// # Ok(()) }
    /// ```
    pub fn migrations(&self) -> Vec<Migration> {
        let record = |version: i32| {
            format!(
                "INSERT INTO {} (version) VALUES ({version});\n",
                self.sql.migrations_table
            )
        };
        scripts(&self.sql)
            .into_iter()
            .enumerate()
            .map(|(i, (version, script))| {
                let mut sql = String::new();
                if i == 0 {
                    sql.push_str(&self.migrations_preamble());
                }
                sql.push_str(script.trim_end());
                sql.push_str("\n\n");
                sql.push_str(&record(version));
                Migration { version, sql }
            })
            .collect()
    }

    /// Every migration of [`migrations`](Self::migrations) as one script, for a schema
    /// that has none of them: what [`migrate`](Self::migrate) would apply there, and the
    /// record of it. Apply it in one transaction (`psql --single-transaction`;
    /// migration tools do): its first statement takes `migrate()`'s advisory lock, so
    /// that a replica's `migrate()` waits for it to commit. Nothing connects.
    ///
    /// ```
    /// use tower_idempotency::store::PostgresStore;
    ///
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let store = PostgresStore::connect("postgres://app@db.internal/payments")?
    ///     .with_schema_name("billing")?;
    /// // std::fs::write("migrations/20250101000000_idempotency.sql", store.migration_sql())?;
    /// let sql = store.migration_sql();
    /// assert!(sql.contains(r#"CREATE OR REPLACE FUNCTION "billing"."idempotency_keys_claim""#));
    /// # Ok(()) }
    /// ```
    pub fn migration_sql(&self) -> String {
        let migrations = self.migrations();
        let versions: Vec<String> = migrations.iter().map(|m| m.version.to_string()).collect();
        let mut sql = format!(
            "-- tower-idempotency {}: migrations {} of the table {},
-- as PostgresStore::migrate() applies them to a schema that has none.
--
-- Apply this in one transaction (psql --single-transaction; migration tools do). Each
-- migration records itself in the table's record of migrations, as migrate() does:
-- migrate() then finds nothing to apply, and verify() checks the record.

-- Held until this transaction commits: a replica's migrate() waits for it.
SELECT pg_advisory_xact_lock({MIGRATION_LOCK});
",
            env!("CARGO_PKG_VERSION"),
            versions.join(", "),
            self.sql.qualified,
        );
        for migration in migrations {
            let _ = write!(
                sql,
                "\n-- Migration {}\n{}",
                migration.version, migration.sql
            );
        }
        sql
    }

    /// What the first migration begins with: the schema, if it is missing (creating it
    /// needs `CREATE` on the database, and only then), and `<table>_migrations`; for a
    /// table in generations, the partitioned table, which `migrate` creates in place of
    /// the plain one when there is none.
    fn migrations_preamble(&self) -> String {
        let mut sql = format!(
            "-- The schema, if it is missing (creating it needs CREATE on the database).
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_namespace WHERE nspname = '{schema}') THEN
        CREATE SCHEMA \"{schema}\";
    END IF;
END
$$;

-- The record of the migrations applied, which migrate() and verify() read.
{record}

",
            schema = self.schema,
            record = self.create_migrations_table(),
        );
        if let Some(names) = &self.sql.generations {
            sql.push_str(generations::create_sql(names).trim_end());
            sql.push_str("\n\n");
        }
        sql
    }

    /// The statement that creates `<table>_migrations` where it does not exist.
    fn create_migrations_table(&self) -> String {
        create_migrations_table(&self.sql)
    }

    /// The hint of an error of `migrate` at `step` with SQLSTATE `code`: for a
    /// permission error, the right that step needs; for anything else, none (a missing
    /// table there is no sign of a store not migrated).
    fn migration_hint(&self, step: Step, code: &SqlState) -> Option<Cow<'static, str>> {
        if *code != SqlState::INSUFFICIENT_PRIVILEGE {
            return None;
        }
        let hint = match step {
            Step::Reading => format!(
                "migrate() reads {}: the role needs USAGE on schema \"{}\" and SELECT on that table (docs/postgres.md, \"Privileges\")",
                self.sql.migrations_table, self.schema
            ),
            Step::CreatingSchema => format!(
                "migrate() creates the missing schema \"{schema}\", which needs CREATE on the database: grant it, or create the schema beforehand (CREATE SCHEMA \"{schema}\" AUTHORIZATION <the migrating role>) and grant USAGE and CREATE on it (docs/postgres.md, \"Privileges\")",
                schema = self.schema
            ),
            Step::Applying => format!(
                "applying migrations to {} needs USAGE and CREATE on schema \"{}\", and to own the table and its functions to change them: run migrate() as their owner, or apply migration_sql() with your migration tool as a role that may (docs/postgres.md, \"Privileges\")",
                self.sql.qualified, self.schema
            ),
        };
        Some(hint.into())
    }

    /// How a failed statement of `migrate` at `step` is reported: classified, with the
    /// hint of that step.
    fn migration_failed(&self, step: Step) -> impl Fn(tokio_postgres::Error) -> StoreError {
        move |e| classify_with(e, |code| self.migration_hint(step, code))
    }

    /// Whether the table exists and `<table>_migrations` records every migration: then
    /// `migrate` has nothing to do, and needs no privilege beyond reading the record (an
    /// app role that may not create objects, its tables made by an owner role).
    pub(super) async fn migrated(
        &self,
        client: &impl deadpool_postgres::GenericClient,
    ) -> Result<bool, StoreError> {
        let found = client
            .query_one(
                "SELECT to_regclass($1) IS NOT NULL, to_regclass($2) IS NOT NULL",
                &[&self.sql.qualified, &self.sql.migrations_table],
            )
            .await
            .map_err(self.migration_failed(Step::Reading))?;
        let (table, record): (bool, bool) = (found.get(0), found.get(1));
        if !(table && record) {
            return Ok(false);
        }
        let applied = self.applied(client).await?;
        Ok(scripts(&self.sql).iter().all(|(v, _)| applied.contains(v)))
    }

    /// The versions `<table>_migrations` records.
    pub(super) async fn applied(
        &self,
        client: &impl deadpool_postgres::GenericClient,
    ) -> Result<Vec<i32>, StoreError> {
        let sql = format!("SELECT version FROM {}", self.sql.migrations_table);
        let rows = client
            .query(&sql, &[])
            .await
            .map_err(self.migration_failed(Step::Reading))?;
        Ok(rows.iter().map(|r| r.get(0)).collect())
    }

    /// One attempt of [`migrate`](Self::migrate), in one transaction.
    pub(super) async fn migrate_once(&self) -> Result<(), Failure> {
        let mut client = pooled(&self.pool).await?;
        // Everything in one transaction, the check too: its statements, prepared and
        // closed inside it, stay on one server session behind a transaction pooler.
        // Read committed whatever the database's default: a replica that waited on the
        // lock must see the versions the one before it applied. Under repeatable read or
        // serializable its snapshot, taken before the wait, would not, and it would apply
        // them again and fail on their rows.
        let tx = client
            .build_transaction()
            .isolation_level(tokio_postgres::IsolationLevel::ReadCommitted)
            .start()
            .await
            .map_err(|e| classify_with(e, |_| None))?;
        let applying = self.migration_failed(Step::Applying);
        if self.migrated(&tx).await? {
            return Ok(tx.commit().await.map_err(|e| classify_with(e, |_| None))?);
        }
        // A lock_timeout, statement_timeout or (PostgreSQL 17) transaction_timeout of the
        // role or database would end the wait for another replica's migrations, which
        // may take as long as they take. Only the settings this server has are set.
        // `IF NOT EXISTS` on what exists (what another replica just made) draws a
        // notice, which tokio-postgres logs at `info`: expected, so not sent.
        tx.batch_execute(
            "SET LOCAL client_min_messages = warning;
             SELECT set_config(name, '0', true) FROM pg_settings
             WHERE name IN ('lock_timeout', 'statement_timeout', 'transaction_timeout')",
        )
        .await
        .map_err(&applying)?;
        tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK])
            .await
            .map_err(&applying)?;
        // Only a missing schema is created: `CREATE SCHEMA IF NOT EXISTS` asks for
        // `CREATE` on the database even when the schema exists, which a role that may
        // create in its schema only lacks. Any other creator of the schema took this
        // lock too, or is settled by `IF NOT EXISTS`.
        let schema_exists: bool = tx
            .query_one(
                "SELECT EXISTS (SELECT FROM pg_namespace WHERE nspname = $1)",
                &[&self.schema],
            )
            .await
            .map_err(&applying)?
            .get(0);
        if !schema_exists {
            tx.batch_execute(&format!("CREATE SCHEMA IF NOT EXISTS \"{}\"", self.schema))
                .await
                .map_err(self.migration_failed(Step::CreatingSchema))?;
        }
        tx.batch_execute(&self.create_migrations_table())
            .await
            .map_err(&applying)?;
        let applied = self.applied(&tx).await?;
        // Recorded, but gone (dropped by hand): the migrations cannot be applied again
        // over what they left (its function, say) without knowing what is left.
        let table: bool = tx
            .query_one("SELECT to_regclass($1) IS NOT NULL", &[&self.sql.qualified])
            .await
            .map_err(&applying)?
            .get(0);
        if !applied.is_empty() && !table {
            return Err(Failure::Failed(StoreError::new(
                StoreErrorKind::Misconfigured,
                format!(
                    "{} is missing, but {} records migrations {applied:?}: it was dropped by hand; drop {} too, and {} (its function), then run migrate() again to create them afresh",
                    self.sql.qualified,
                    self.sql.migrations_table,
                    self.sql.migrations_table,
                    self.sql.claim_function,
                ),
            )));
        }
        // Set once the advisory lock is held, for the migrations alone: replicas wait
        // for each other's migrations as long as they take, but none waits long on the
        // table itself.
        tx.batch_execute(&format!(
            "SET LOCAL lock_timeout = {}",
            MIGRATION_LOCK_TIMEOUT.as_millis()
        ))
        .await
        .map_err(&applying)?;
        self.create_generations_if_absent(&tx, &applying).await?;
        for (version, sql) in scripts(&self.sql) {
            if applied.contains(&version) {
                continue;
            }
            tx.batch_execute(&sql).await.map_err(|e| {
                if e.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) {
                    Failure::TableBusy(version)
                } else {
                    Failure::Failed(applying(e))
                }
            })?;
            tx.execute(
                &format!(
                    "INSERT INTO {} (version) VALUES ($1)",
                    self.sql.migrations_table
                ),
                &[&version],
            )
            .await
            .map_err(&applying)?;
        }
        Ok(tx.commit().await.map_err(|e| classify_with(e, |_| None))?)
    }
}
