//! `verify`: the schema a store finds, checked against the one it needs, changing
//! nothing, for an app whose tables are migrated by a tool of its team's.
//!
//! What the store needs is what its migrations make: they are applied to the session's
//! temporary schema, in a transaction rolled back at the end, and the catalog describes
//! both tables alike (columns and their types, constraints, indexes, functions), so
//! that every embedded migration, present or future, is checked without a list of its
//! own to keep up to date. The record of the migrations and the role's rights are
//! checked besides.

use std::{borrow::Cow, collections::BTreeSet};

use tokio_postgres::error::SqlState;

use super::{
    PostgresStore, checkout::pooled, errors::classify_with, generations, migrate::scripts, sql::Sql,
};
use crate::store::{StoreError, StoreErrorKind};

/// What the catalog says of the objects of one table, in schema `$1`, named `$2` or
/// beginning with `$2_`, as rows of (kind, object, detail, rights held): its tables
/// (not partitions, which come and go; plain, unlogged or partitioned), their columns
/// (type, `NOT NULL`, default),
/// constraints and indexes (their definitions, free of the schema's name), its
/// functions (arguments and result), and the schema. Rights are the role's own, on the
/// tables, the functions and the schema.
const SHAPE: &str = "
WITH ns AS (SELECT oid FROM pg_namespace WHERE nspname = $1),
rel AS (
    SELECT c.oid, c.relname::text AS relname, c.relkind, c.relpersistence
    FROM pg_class c JOIN ns ON c.relnamespace = ns.oid
    WHERE c.relkind IN ('r', 'p') AND NOT c.relispartition
      AND (c.relname::text = $2 OR starts_with(c.relname::text, $2 || '_'))),
fns AS (
    SELECT p.oid, p.proname::text AS proname
    FROM pg_proc p JOIN ns ON p.pronamespace = ns.oid
    WHERE starts_with(p.proname::text, $2 || '_'))
SELECT 'schema', $1::text, NULL::text,
       CASE WHEN has_schema_privilege(ns.oid, 'USAGE') THEN 'USAGE' ELSE '' END
FROM ns
UNION ALL
SELECT 'table', relname,
       CASE WHEN relkind = 'p' THEN 'partitioned'
            WHEN relpersistence = 'u' THEN 'unlogged' ELSE 'plain' END,
       concat_ws(',', CASE WHEN has_table_privilege(oid, 'SELECT') THEN 'SELECT' END,
                      CASE WHEN has_table_privilege(oid, 'INSERT') THEN 'INSERT' END,
                      CASE WHEN has_table_privilege(oid, 'UPDATE') THEN 'UPDATE' END,
                      CASE WHEN has_table_privilege(oid, 'DELETE') THEN 'DELETE' END)
FROM rel
UNION ALL
SELECT 'column', r.relname || '.' || a.attname,
       format_type(a.atttypid, a.atttypmod)
       || CASE WHEN a.attnotnull THEN ' NOT NULL' ELSE '' END
       || coalesce(' DEFAULT ' || pg_get_expr(d.adbin, d.adrelid), ''),
       NULL
FROM rel r
JOIN pg_attribute a ON a.attrelid = r.oid AND a.attnum > 0 AND NOT a.attisdropped
LEFT JOIN pg_attrdef d ON d.adrelid = r.oid AND d.adnum = a.attnum
UNION ALL
SELECT 'constraint', r.relname, pg_get_constraintdef(c.oid), NULL
FROM rel r JOIN pg_constraint c ON c.conrelid = r.oid AND c.contype IN ('p', 'u', 'c', 'x')
UNION ALL
SELECT 'index', r.relname,
       CASE WHEN i.indisunique THEN 'UNIQUE ' ELSE '' END
       || substring(pg_get_indexdef(i.indexrelid) FROM ' (USING .*)$'),
       NULL
FROM rel r JOIN pg_index i ON i.indrelid = r.oid
UNION ALL
SELECT 'function', f.proname || '(' || pg_get_function_identity_arguments(f.oid) || ')',
       pg_get_function_result(f.oid),
       CASE WHEN has_function_privilege(f.oid, 'EXECUTE') THEN 'EXECUTE' ELSE '' END
FROM fns f";

/// One row of [`SHAPE`].
struct Fact {
    kind: String,
    object: String,
    detail: Option<String>,
    rights: Option<String>,
}

/// The rows of [`SHAPE`] for one table.
struct Shape(Vec<Fact>);

impl Shape {
    async fn read(
        client: &impl deadpool_postgres::GenericClient,
        schema: &str,
        table: &str,
    ) -> Result<Self, tokio_postgres::Error> {
        let rows = client.query(SHAPE, &[&schema, &table]).await?;
        Ok(Self(
            rows.iter()
                .map(|row| Fact {
                    kind: row.get(0),
                    object: row.get(1),
                    detail: row.get(2),
                    rights: row.get(3),
                })
                .collect(),
        ))
    }

    /// The fact of `kind` about `object`, if there is one.
    fn find(&self, kind: &str, object: &str) -> Option<&Fact> {
        self.0.iter().find(|f| f.kind == kind && f.object == object)
    }

    /// Whether there is a fact of `kind` about `object` with `detail`.
    fn has(&self, kind: &str, object: &str, detail: Option<&str>) -> bool {
        self.0
            .iter()
            .any(|f| f.kind == kind && f.object == object && f.detail.as_deref() == detail)
    }

    /// Says that the table `name` is unlogged (see [`unlogged_in_temporary`]).
    fn unlogged(&mut self, name: &str) {
        for fact in &mut self.0 {
            if fact.kind == "table" && fact.object == name {
                fact.detail = Some("unlogged".to_owned());
            }
        }
    }

    /// The facts of `kind`.
    fn of<'a>(&'a self, kind: &'a str) -> impl Iterator<Item = &'a Fact> + 'a {
        self.0.iter().filter(move |f| f.kind == kind)
    }
}

/// `script`, to run in the temporary schema, where a table cannot be unlogged (every
/// table there is temporary): its `CREATE UNLOGGED TABLE`s made plain, and the names
/// of those tables, which the reference then says are unlogged.
fn unlogged_in_temporary(script: &str) -> (String, Vec<String>) {
    const UNLOGGED: &str = "CREATE UNLOGGED TABLE IF NOT EXISTS ";
    let names = script
        .match_indices(UNLOGGED)
        .filter_map(|(at, _)| {
            let qualified = script[at + UNLOGGED.len()..].split_whitespace().next()?;
            let table = qualified.rsplit_once("\".\"").map_or(qualified, |(_, t)| t);
            Some(table.trim_matches('"').to_owned())
        })
        .collect();
    (
        script.replace(UNLOGGED, "CREATE TABLE IF NOT EXISTS "),
        names,
    )
}

/// Whether `fact` records `right` among the rights held.
fn holds(fact: &Fact, right: &str) -> bool {
    fact.rights
        .as_deref()
        .is_some_and(|rights| rights.split(',').any(|r| r == right))
}

/// What [`PostgresStore::verify`] found wrong, by what fixes it.
#[derive(Default)]
struct Findings {
    /// Objects missing or of another shape than the migrations make.
    shape: Vec<String>,
    /// Migrations the record lacks.
    unapplied: Vec<i32>,
    /// The table is there, its record of migrations is not.
    no_record: bool,
    /// Rights the role lacks.
    rights: Vec<String>,
}

impl PostgresStore {
    /// Checks, changing nothing, that the schema this store finds is the one it needs:
    /// its table, with every column of the right type, nullability and default, its
    /// primary key and other constraints, the indexes its statements rely on, the
    /// unlogged table its holders register in (liveness), its functions (the claim's
    /// insert, a table in generations' own) with their arguments and results, the record of every migration in `<table>_migrations`,
    /// and the role's rights to serve (docs/postgres.md, "Privileges"). For an app
    /// whose team migrates with its own tool ([`migration_sql`](Self::migration_sql)),
    /// to call at start-up instead of [`migrate`](Self::migrate).
    ///
    /// What the store needs is what its migrations make: `verify` applies them to its
    /// session's temporary schema, in a transaction it rolls back, and compares what the
    /// catalog says of both. So it needs `TEMPORARY` on the database (which PostgreSQL
    /// grants to everyone by default) besides the app's rights. What the found schema has
    /// beyond that (a column, an index of the team's own) is not reported.
    ///
    /// ```no_run
    /// use tower_idempotency::{IdempotencyLayer, store::PostgresStore};
    ///
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// let store = PostgresStore::connect("postgres://app@db.internal/payments")?
    ///     .with_schema_name("billing")?;
    /// // Migrated by the team's own tool, from `store.migration_sql()`:
    /// store.verify().await?;
    /// let layer = IdempotencyLayer::new(store);
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// A [`StoreError`] of kind [`Misconfigured`](crate::store::StoreErrorKind::Misconfigured)
    /// naming everything missing or different (the schema, a column and the type it
    /// should have, an index, a function, the migrations not recorded, a right the
    /// role lacks), and what to do about it; [`Unavailable`](crate::store::StoreErrorKind::Unavailable)
    /// when the database cannot be reached.
    pub async fn verify(&self) -> Result<(), StoreError> {
        let plain = |e| classify_with(e, |_| None);
        let mut client = pooled(&self.pool).await?;
        let tx = client
            .build_transaction()
            .isolation_level(tokio_postgres::IsolationLevel::ReadCommitted)
            .start()
            .await
            .map_err(plain)?;
        // What the migrations make, in the session's temporary schema, rolled back
        // below. (`IF NOT EXISTS` draws notices there too.)
        let reference = Sql::new(
            "pg_temp",
            &self.table,
            self.sql.generations.is_some(),
            self.sql.remember,
        );
        let mut script = String::from("SET LOCAL client_min_messages = warning;\n");
        if let Some(names) = &reference.generations {
            script.push_str(&generations::create_sql(names));
            script.push('\n');
        }
        for (_, sql) in scripts(&reference) {
            script.push_str(&sql);
            script.push('\n');
        }
        let (script, unlogged) = unlogged_in_temporary(&script);
        tx.batch_execute(&script)
            .await
            .map_err(|e| classify_with(e, temporary_hint))?;
        let temporary: String = tx
            .query_one("SELECT pg_my_temp_schema()::regnamespace::text", &[])
            .await
            .map_err(plain)?
            .get(0);
        let mut needed = Shape::read(&tx, &temporary, &self.table)
            .await
            .map_err(plain)?;
        for table in &unlogged {
            needed.unlogged(table);
        }
        let found = Shape::read(&tx, &self.schema, &self.table)
            .await
            .map_err(plain)?;
        let mut findings = self.compare(&needed, &found);
        // The record, where it can be read.
        let record = format!("{}_migrations", self.table);
        if let Some(fact) = found.find("table", &record)
            && holds(fact, "SELECT")
        {
            let applied = self.applied(&tx).await?;
            findings.unapplied = scripts(&self.sql)
                .into_iter()
                .map(|(version, _)| version)
                .filter(|version| !applied.contains(version))
                .collect();
        } else if found.find("schema", &self.schema).is_some()
            && found.find("table", &self.table).is_some()
            && found.find("table", &record).is_none()
        {
            findings.no_record = true;
        }
        tx.rollback().await.map_err(plain)?;
        self.verdict(findings)
    }

    /// What `found` lacks of `needed`, and the rights the role lacks on what is there.
    fn compare(&self, needed: &Shape, found: &Shape) -> Findings {
        let mut findings = Findings::default();
        let Some(schema) = found.find("schema", &self.schema) else {
            findings
                .shape
                .push(format!("schema \"{}\" does not exist", self.schema));
            return findings;
        };
        if !holds(schema, "USAGE") {
            findings
                .rights
                .push(format!("USAGE on schema \"{}\"", self.schema));
        }
        let name = |table: &str| format!("\"{}\".\"{table}\"", self.schema);
        // Where a column, a constraint or an index is: said for a table other than the
        // store's own, which the error names first.
        let of = |table: &str| {
            if table == self.table {
                String::new()
            } else {
                format!(" of {}", name(table))
            }
        };
        let mut missing = BTreeSet::new();
        for table in needed.of("table") {
            let Some(there) = found.find("table", &table.object) else {
                findings
                    .shape
                    .push(format!("table {} is missing", name(&table.object)));
                missing.insert(table.object.as_str());
                continue;
            };
            if there.detail != table.detail {
                let (there, needs) = (
                    there.detail.as_deref().unwrap_or_default(),
                    table.detail.as_deref().unwrap_or_default(),
                );
                let a = |what: &str| {
                    if what.starts_with(['a', 'e', 'i', 'o', 'u']) {
                        "an"
                    } else {
                        "a"
                    }
                };
                findings.shape.push(format!(
                    "{} is {} {there} table, where this store needs {} {needs} one{}",
                    name(&table.object),
                    a(there),
                    a(needs),
                    if there != "partitioned" && needs != "partitioned" {
                        ""
                    } else if self.sql.generations.is_some() {
                        " (it is built with_generations)"
                    } else {
                        " (it is built without generations)"
                    }
                ));
            }
            // The table the store serves from, the one its holders register in
            // (liveness) and the one its steps are recorded in, are read and written; the others (a table in generations'
            // list of them) are read.
            let holders = format!("{}_holders", self.table);
            let steps = format!("{}_steps", self.table);
            let written = [&self.table, &holders, &steps];
            let rights: &[&str] = if written.contains(&&table.object) {
                &["SELECT", "INSERT", "UPDATE", "DELETE"]
            } else {
                &["SELECT"]
            };
            let lacking: Vec<&str> = rights
                .iter()
                .copied()
                .filter(|right| !holds(there, right))
                .collect();
            if !lacking.is_empty() {
                findings
                    .rights
                    .push(format!("{} on {}", lacking.join(", "), name(&table.object)));
            }
        }
        for column in needed.of("column") {
            let Some((table, column_name)) = column.object.split_once('.') else {
                continue;
            };
            if missing.contains(table) {
                continue;
            }
            let wanted = column.detail.as_deref().unwrap_or_default();
            match found.find("column", &column.object) {
                None => findings.shape.push(format!(
                    "column \"{column_name}\"{} is missing (this store needs {wanted})",
                    of(table)
                )),
                Some(there) if there.detail != column.detail => findings.shape.push(format!(
                    "column \"{column_name}\"{} is {}, where this store needs {wanted}",
                    of(table),
                    there.detail.as_deref().unwrap_or_default()
                )),
                Some(_) => {}
            }
        }
        for (kind, what) in [("constraint", "the constraint"), ("index", "an index")] {
            for needed in needed.of(kind) {
                if missing.contains(needed.object.as_str())
                    || found.has(kind, &needed.object, needed.detail.as_deref())
                {
                    continue;
                }
                findings.shape.push(format!(
                    "{what} {}{} is missing",
                    needed.detail.as_deref().unwrap_or_default(),
                    of(&needed.object)
                ));
            }
        }
        for function in needed.of("function") {
            let wanted = function.detail.as_deref().unwrap_or_default();
            match found.find("function", &function.object) {
                None => findings.shape.push(format!(
                    "function \"{}\".{} is missing",
                    self.schema, function.object
                )),
                Some(there) if there.detail != function.detail => {
                    findings.shape.push(format!(
                        "function \"{}\".{} returns {}, where this store needs {wanted}",
                        self.schema,
                        function.object,
                        there.detail.as_deref().unwrap_or_default()
                    ));
                }
                Some(there) if !holds(there, "EXECUTE") => findings.rights.push(format!(
                    "EXECUTE on function \"{}\".{}",
                    self.schema, function.object
                )),
                Some(_) => {}
            }
        }
        let record = format!("{}_migrations", self.table);
        if let Some(there) = found.find("table", &record)
            && !holds(there, "SELECT")
        {
            findings
                .rights
                .push(format!("SELECT on {}", self.sql.migrations_table));
        }
        findings
    }

    /// `Ok` when nothing was found wrong; else an error naming it all, and what to do.
    fn verdict(&self, findings: Findings) -> Result<(), StoreError> {
        let Findings {
            shape,
            unapplied,
            no_record,
            rights,
        } = findings;
        let mut problems = shape.clone();
        let mut hints = Vec::new();
        if no_record {
            problems.push(format!(
                "{} is missing: no migration is recorded",
                self.sql.migrations_table
            ));
            hints.push(
                "a table made by other means than migrate() or migration_sql() is not known to be the one this store needs: run migrate(), or apply migration_sql() with your migration tool, on a schema without it"
                    .to_owned(),
            );
        } else if !unapplied.is_empty() {
            problems.push(format!(
                "{} does not record migration{} {}",
                self.sql.migrations_table,
                if unapplied.len() == 1 { "" } else { "s" },
                unapplied
                    .iter()
                    .map(i32::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
            hints.push(
                "apply the missing migrations: run migrate(), or apply those of migrations() with your migration tool"
                    .to_owned(),
            );
        } else if !shape.is_empty() {
            hints.push(
                "create or restore what is named as migration_sql() does (run migrate() on a schema without the table, or apply migration_sql() with your migration tool)"
                    .to_owned(),
            );
        }
        if !rights.is_empty() {
            problems.push(format!("the role lacks {}", rights.join("; ")));
            hints.push("grant the app's rights (docs/postgres.md, \"Privileges\")".to_owned());
        }
        if problems.is_empty() {
            return Ok(());
        }
        Err(StoreError::new(
            StoreErrorKind::Misconfigured,
            format!(
                "{} is not as this store needs it: {}",
                self.sql.qualified,
                problems.join("; ")
            ),
        )
        .with_hint(hints.join("; ")))
    }
}

/// The hint of a failure to make the reference in the temporary schema.
fn temporary_hint(code: &SqlState) -> Option<Cow<'static, str>> {
    (*code == SqlState::INSUFFICIENT_PRIVILEGE).then_some(Cow::Borrowed(
        "verify() applies the store's migrations to a temporary schema of its own session, rolled back, to compare: the role needs TEMPORARY on the database (PostgreSQL grants it to everyone by default)",
    ))
}
