//! Migrations: the schema, the table and its functions, created and brought up to date
//! under an advisory lock, in one read committed transaction, from `migrations/`.

use std::time::Duration;

use tokio_postgres::error::SqlState;

use super::{PostgresStore, checkout::pooled, errors::classify};
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
];

/// An advisory lock id shared by every process migrating this crate's tables.
pub(super) const MIGRATION_LOCK: i64 = 0x7469_6465_6d70_6f74; // "tidempot"

/// How long a migration waits to lock the table, and how many times it tries (see
/// `migrate`).
pub(super) const MIGRATION_LOCK_TIMEOUT: Duration = Duration::from_secs(1);
pub(super) const MIGRATION_ATTEMPTS: u32 = 3;

/// Why an attempt to migrate failed.
pub(super) enum Migration {
    /// This migration could not lock the table within `MIGRATION_LOCK_TIMEOUT`.
    TableBusy(i32),
    Failed(StoreError),
}

impl From<StoreError> for Migration {
    fn from(e: StoreError) -> Self {
        Self::Failed(e)
    }
}

impl PostgresStore {
    /// Creates the schema and table and applies pending migrations.
    ///
    /// Safe to run from several processes at once: migrations are serialised by a
    /// transaction-scoped advisory lock, in a read committed transaction whatever the
    /// database's default isolation and timeouts, and recorded in `<table>_migrations`.
    /// Once everything is applied it only reads that record, so a role that may not
    /// create objects can run it (docs/postgres.md lists the grants).
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
    /// when the role may not create what is missing, and [`Unavailable`](crate::store::StoreErrorKind::Unavailable)
    /// when the database cannot be reached. Nothing is half applied: each migration is
    /// one transaction.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        let mut attempt = 1;
        loop {
            match self.migrate_once().await {
                Err(Migration::TableBusy(version)) if attempt < MIGRATION_ATTEMPTS => {
                    tracing::warn!(
                        version,
                        table = %self.sql.qualified,
                        "a migration could not lock the table; trying again"
                    );
                    attempt += 1;
                    let wait = 1000 + crate::random::u64() % 1000;
                    tokio::time::sleep(Duration::from_millis(wait)).await;
                }
                Err(Migration::TableBusy(version)) => {
                    return Err(StoreError::new(
                        StoreErrorKind::Timeout,
                        format!(
                            "migration {version} could not lock {} within {} ms, {MIGRATION_ATTEMPTS} times: a long transaction holds the table; nothing was applied, run migrate() again when the table is quiet",
                            self.sql.qualified,
                            MIGRATION_LOCK_TIMEOUT.as_millis()
                        ),
                    ));
                }
                Err(Migration::Failed(e)) => return Err(e),
                Ok(()) => return Ok(()),
            }
        }
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
            .map_err(classify)?;
        let (table, record): (bool, bool) = (found.get(0), found.get(1));
        if !(table && record) {
            return Ok(false);
        }
        let applied = self.applied(client).await?;
        Ok(MIGRATIONS.iter().all(|(v, _)| applied.contains(v))
            && (self.sql.generations.is_none()
                || super::generations::VERSIONS
                    .iter()
                    .all(|(v, _)| applied.contains(v))))
    }

    /// The versions `<table>_migrations` records.
    pub(super) async fn applied(
        &self,
        client: &impl deadpool_postgres::GenericClient,
    ) -> Result<Vec<i32>, StoreError> {
        let sql = format!("SELECT version FROM {}", self.sql.migrations_table);
        let rows = client.query(&sql, &[]).await.map_err(classify)?;
        Ok(rows.iter().map(|r| r.get(0)).collect())
    }

    /// One attempt of [`migrate`](Self::migrate), in one transaction.
    pub(super) async fn migrate_once(&self) -> Result<(), Migration> {
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
            .map_err(classify)?;
        if self.migrated(&tx).await? {
            return Ok(tx.commit().await.map_err(classify)?);
        }
        // A lock_timeout, statement_timeout or (PostgreSQL 17) transaction_timeout of the
        // role or database would end the wait for another replica's migrations, which
        // may take as long as they take. Only the settings this server has are set.
        // `IF NOT EXISTS` on what exists (a schema made by hand, what another replica
        // just made) draws a notice, which tokio-postgres logs at `info`: expected, so
        // not sent.
        tx.batch_execute(
            "SET LOCAL client_min_messages = warning;
             SELECT set_config(name, '0', true) FROM pg_settings
             WHERE name IN ('lock_timeout', 'statement_timeout', 'transaction_timeout')",
        )
        .await
        .map_err(classify)?;
        tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK])
            .await
            .map_err(classify)?;
        tx.batch_execute(&format!(
            "CREATE SCHEMA IF NOT EXISTS \"{}\";
             CREATE TABLE IF NOT EXISTS {} (
                 version integer PRIMARY KEY,
                 applied_at timestamptz NOT NULL DEFAULT now())",
            self.schema, self.sql.migrations_table
        ))
        .await
        .map_err(classify)?;
        let applied = self.applied(&tx).await?;
        // Recorded, but gone (dropped by hand): the migrations cannot be applied again
        // over what they left (its function, say) without knowing what is left.
        let table: bool = tx
            .query_one("SELECT to_regclass($1) IS NOT NULL", &[&self.sql.qualified])
            .await
            .map_err(classify)?
            .get(0);
        if !applied.is_empty() && !table {
            return Err(Migration::Failed(StoreError::new(
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
        .map_err(classify)?;
        self.create_generations_if_absent(&tx).await?;
        for (version, sql) in MIGRATIONS {
            if applied.contains(version) {
                continue;
            }
            let sql = sql
                .replace("{{table}}", &self.sql.qualified)
                .replace("{{expires_index}}", &self.sql.expires_index)
                .replace("{{claim_function}}", &self.sql.claim_function)
                .replace("{{holders}}", &self.sql.holders)
                .replace("{{holder_gone_function}}", &self.sql.holder_gone_function);
            tx.batch_execute(&sql).await.map_err(|e| {
                if e.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) {
                    Migration::TableBusy(*version)
                } else {
                    Migration::Failed(classify(e))
                }
            })?;
            tx.execute(
                &format!(
                    "INSERT INTO {} (version) VALUES ($1)",
                    self.sql.migrations_table
                ),
                &[version],
            )
            .await
            .map_err(classify)?;
        }
        self.migrate_generations(&tx, &applied).await?;
        Ok(tx.commit().await.map_err(classify)?)
    }
}
