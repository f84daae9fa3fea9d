//! The store's schema as a team meets it: the rights migrating and serving need (as
//! docs/postgres.md lists them), the errors of a role that lacks them, the SQL a team
//! applies with its own tool (`migration_sql`, applied by the real `psql`), and
//! `verify`, which checks what it finds without changing it.
//!
//! Every role and database here is the test's own, dropped when it ends; so is every
//! schema.

mod common;

use std::{
    io::Write as _,
    process::{Command, Stdio},
    time::Duration,
};

use common::{TestDatabase, TestRole, TestSchema, app, post, post_with_headers, send};
use tower_idempotency::{
    Fingerprint, IdempotencyLayer, Outcome, Scope,
    store::{ClaimRequest, PostgresStore, Store, StoreErrorKind, pool_for_url},
};

/// The SQL block of docs/postgres.md whose first line is `first_line`, with the names
/// it uses (`payments`, `billing`, `migrator`, `app`) replaced by the test's own.
fn documented_grants(first_line: &str, database: &str, schema: &str, role: &str) -> String {
    let docs = include_str!("../docs/postgres.md");
    let start = docs
        .find(first_line)
        .unwrap_or_else(|| panic!("docs/postgres.md has no block starting {first_line:?}"));
    let block = &docs[start..];
    let block = &block[..block.find("```").expect("the end of the block")];
    assert!(block.contains("GRANT"), "{block}");
    block
        .replace("DATABASE payments", &format!("DATABASE \"{database}\""))
        .replace("SCHEMA billing", &format!("SCHEMA \"{schema}\""))
        .replace("billing.", &format!("\"{schema}\"."))
        .replace("TO migrator;", &format!("TO \"{role}\";"))
        .replace("TO app;", &format!("TO \"{role}\";"))
}

const MIGRATE_RIGHTS: &str = "-- The rights migrate() needs";
const APP_RIGHTS: &str = "-- The rights the app needs";

/// A store on `url`, with the default table (`public.idempotency_keys`) unless `schema`.
fn store_on(url: &str, schema: Option<&str>) -> PostgresStore {
    let store = PostgresStore::new(pool_for_url(url, 4).expect("pool"))
        .with_notifications(url.parse().expect("url"));
    match schema {
        Some(schema) => store.with_schema_name(schema).expect("schema name"),
        None => store,
    }
}

fn claim_request<'a>(scope: &'a Scope, key: &'a str) -> ClaimRequest<'a> {
    ClaimRequest {
        scope,
        key,
        fingerprint: Fingerprint::new([7; 32]),
        lease: Duration::from_secs(30),
        ttl: Duration::from_secs(3600),
    }
}

/// Runs `sql` (one or more statements) on `url`, as whoever `url` names.
async fn run(url: &str, sql: &str) {
    let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .expect("connect");
    tokio::spawn(conn);
    client.batch_execute(sql).await.expect("run");
}

/// The one boolean `sql` returns on `url`.
async fn query_bool(url: &str, sql: &str) -> bool {
    let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .expect("connect");
    tokio::spawn(conn);
    client.query_one(sql, &[]).await.expect("query").get(0)
}

/// Applies `sql` with the real `psql`, in one transaction, stopping at the first error.
fn psql(url: &str, sql: &str) {
    let mut child = Command::new("psql")
        .args([
            "-X",
            "-q",
            "-v",
            "ON_ERROR_STOP=1",
            "--single-transaction",
            "-f",
            "-",
        ])
        .arg(url)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run psql (the PostgreSQL client must be installed)");
    child
        .stdin
        .take()
        .expect("psql's stdin")
        .write_all(sql.as_bytes())
        .expect("write to psql");
    let out = child.wait_with_output().expect("psql ran");
    assert!(
        out.status.success(),
        "psql failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The issue's case: a role that may create in the schema `public` only (PostgreSQL 15
/// no longer lets everyone), which migrating used to refuse (`CREATE SCHEMA IF NOT
/// EXISTS "public"` asks for `CREATE` on the database). With the rights the docs list,
/// it migrates; with the app's rights the docs list, another role serves every kind of
/// statement the store sends, on a database where everyone's default rights are
/// revoked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rights_the_docs_list_are_enough_to_migrate_and_to_serve() {
    let migrator = TestRole::new().await;
    let app_role = TestRole::new().await;
    let db = TestDatabase::new().await;
    db.run(&format!(
        "REVOKE ALL ON DATABASE \"{d}\" FROM PUBLIC; REVOKE ALL ON SCHEMA public FROM PUBLIC;",
        d = db.name
    ))
    .await;
    db.run(&documented_grants(
        MIGRATE_RIGHTS,
        &db.name,
        "public",
        &migrator.name,
    ))
    .await;
    let owner = store_on(&db.url_as(&migrator.name), None);
    owner
        .migrate()
        .await
        .expect("migrate with the documented rights");

    // The app's role, before its grants: verify() cannot even connect.
    let app_url = db.url_as(&app_role.name);
    let e = store_on(&app_url, None).verify().await.unwrap_err();
    assert!(e.to_string().contains("SQLSTATE 42501"), "{e}");
    // Its rights, as the docs list them; what PostgreSQL grants everyone by default
    // on the claim's function revoked, so that only the grant can serve.
    db.run("REVOKE EXECUTE ON ALL FUNCTIONS IN SCHEMA public FROM PUBLIC")
        .await;
    db.run(&documented_grants(
        APP_RIGHTS,
        &db.name,
        "public",
        &app_role.name,
    ))
    .await;
    let store = store_on(&app_url, None);
    store.verify().await.expect("verify as the app's role");
    store
        .migrate()
        .await
        .expect("migrate as the app's role, with nothing to apply");
    store.listen().await.expect("LISTEN as the app's role");
    store
        .start_liveness()
        .await
        .expect("liveness as the app's role: its lock held, its holder registered");

    // Lease mode: a new key, a replay, a 422, a duplicate waiting for a running one
    // (woken by its NOTIFY), a lease renewed, a failure's key released.
    let layer = IdempotencyLayer::new(store.clone())
        .lease_duration(Duration::from_millis(600))
        .wait_for_running(Duration::from_secs(10));
    let (router, counter) = app(layer);
    assert_eq!(send(&router, post("k", "{}")).await.status, 201);
    let replay = send(&router, post("k", "{}")).await;
    assert_eq!(replay.outcome, Some(Outcome::Replayed));
    assert_eq!(send(&router, post("k", r#"{"other":1}"#)).await.status, 422);
    let held = common::in_flight(
        &router,
        post_with_headers("w", &[("x-held", "1"), ("x-delay-ms", "700")]),
        &counter,
    )
    .await;
    let waiter = {
        let router = router.clone();
        tokio::spawn(async move { send(&router, post("w", "{}")).await })
    };
    // Once the duplicate waits (it marked the row), the completion notifies it.
    let marked = "SELECT EXISTS (SELECT FROM public.idempotency_keys WHERE key = 'w' AND waiters)";
    for _ in 0..500 {
        if query_bool(&db.url(), marked).await {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        query_bool(&db.url(), marked).await,
        "the duplicate never waited"
    );
    // The held request's holder renews its sign of life while it runs.
    common::eventually(|| store.metrics().liveness_heartbeats >= 1).await;
    counter.let_go(1);
    assert_eq!(held.await.expect("join").status, 201);
    let waited = waiter.await.expect("join");
    assert_eq!(waited.status, 201);
    assert_eq!(waited.outcome, Some(Outcome::Replayed));
    assert!(
        store.metrics().notified_wakeups >= 1,
        "{:?}",
        store.metrics()
    );
    assert_eq!(
        counter.runs_of("w"),
        1,
        "the held request ran once, renewed"
    );
    let failed = send(&router, post_with_headers("f", &[("x-status", "500")])).await;
    assert_eq!(failed.status, 500);
    assert_eq!(send(&router, post("f", "{}")).await.status, 201);
    assert_eq!(counter.runs_of("f"), 2, "the failure's key was released");
    store
        .purge_expired(100)
        .await
        .expect("purge as the app's role");
    let scope = Scope::anonymous();
    assert!(store.look_up(&scope, "k").await.expect("look up").is_some());

    // Transactional mode.
    let (router, counter) = app(IdempotencyLayer::transactional(store.clone()));
    assert_eq!(send(&router, post("t", "{}")).await.status, 201);
    let replay = send(&router, post("t", "{}")).await;
    assert_eq!(replay.outcome, Some(Outcome::Replayed));
    assert_eq!(counter.runs(), 1);
    common::idle(&store).await;
}

/// A schema that does not exist yet is created by `migrate()` for a role that may
/// create in the database, as the docs say.
#[tokio::test]
async fn a_missing_schema_is_created_for_a_role_that_may_create_in_the_database() {
    let role = TestRole::new().await;
    let db = TestDatabase::new().await;
    db.run(&format!(
        "GRANT CREATE ON DATABASE \"{}\" TO \"{}\"",
        db.name, role.name
    ))
    .await;
    let store = store_on(&db.url_as(&role.name), Some("billing"));
    store.migrate().await.expect("migrate into a new schema");
    store.verify().await.expect("verify");
    let scope = Scope::anonymous();
    store
        .claim(&claim_request(&scope, "k"))
        .await
        .expect("claim");
}

/// A role with no rights on a fresh database: `migrate()` says what PostgreSQL said,
/// with its SQLSTATE, and which right creating the schema needs; it does not blame
/// `migrate()` for not having run.
#[tokio::test]
async fn migrating_without_rights_says_permission_denied_and_which_right_it_needs() {
    let role = TestRole::new().await;
    let db = TestDatabase::new().await;
    let e = store_on(&db.url_as(&role.name), Some("billing"))
        .migrate()
        .await
        .unwrap_err();
    assert_eq!(e.kind(), StoreErrorKind::Misconfigured);
    let shown = e.to_string();
    assert!(
        shown.contains(&format!("permission denied for database {}", db.name)),
        "{shown}"
    );
    assert!(shown.contains("(SQLSTATE 42501)"), "{shown}");
    assert!(shown.contains("CREATE on the database"), "{shown}");
    assert!(!shown.contains("run migrate()"), "{shown}");
    assert!(!shown.contains("was migrate() run"), "{shown}");

    // Where the schema exists, and the role may use it but not create in it.
    db.run(&format!(
        "CREATE SCHEMA billing; GRANT USAGE ON SCHEMA billing TO \"{}\"",
        role.name
    ))
    .await;
    let e = store_on(&db.url_as(&role.name), Some("billing"))
        .migrate()
        .await
        .unwrap_err();
    let shown = e.to_string();
    assert!(
        shown.contains("permission denied for schema billing (SQLSTATE 42501)"),
        "{shown}"
    );
    assert!(
        shown.contains("needs USAGE and CREATE on schema \"billing\""),
        "{shown}"
    );
}

/// While serving, the same SQLSTATE means another likely cause, and gets another hint:
/// a table never migrated (run `migrate()`), a role without the app's rights (which).
#[tokio::test]
async fn a_claim_says_why_it_failed_and_what_to_do() {
    let schema = TestSchema::new();
    let scope = Scope::anonymous();
    let unmigrated = schema.unmigrated_store_at(&common::database_url());
    let e = unmigrated
        .claim(&claim_request(&scope, "k"))
        .await
        .unwrap_err();
    assert_eq!(e.kind(), StoreErrorKind::Misconfigured);
    let shown = e.to_string();
    assert!(
        shown.contains(&format!(
            "relation \"{}.idempotency_keys\" does not exist (SQLSTATE 42P01)",
            schema.name
        )),
        "{shown}"
    );
    assert!(shown.contains("run migrate()"), "{shown}");
    assert_eq!(
        e.hint(),
        Some(&shown[shown.find("the store's table").expect("a hint")..])
    );

    schema.store().await;
    let role = TestRole::new().await;
    role.run(&format!(
        "GRANT USAGE ON SCHEMA \"{}\" TO \"{}\"",
        schema.name, role.name
    ))
    .await;
    let e = schema
        .unmigrated_store_at(&common::url_as(&role.name))
        .claim(&claim_request(&scope, "k"))
        .await
        .unwrap_err();
    let shown = e.to_string();
    assert!(
        shown.contains("permission denied for table idempotency_keys (SQLSTATE 42501)"),
        "{shown}"
    );
    assert!(
        shown.contains("SELECT, INSERT, UPDATE and DELETE on the table"),
        "{shown}"
    );
    assert!(!shown.contains("run migrate()"), "{shown}");
}

/// The SQL a team applies with its own tool: `psql` applies `migration_sql()` into a
/// schema of the test's own (the script creates it), the result passes `verify`, a
/// later `migrate()` finds nothing to apply, and the layer serves from it.
#[tokio::test]
async fn sql_applied_by_psql_passes_verify_and_serves() {
    let schema = TestSchema::new();
    let store = schema.unmigrated_store_at(&common::database_url());
    psql(&common::database_url(), &store.migration_sql());
    store.verify().await.expect("verify what psql applied");
    let recorded = format!(
        "SELECT count(*), max(applied_at)::text FROM \"{}\".idempotency_keys_migrations",
        schema.name
    );
    let before = schema.query(&recorded).await;
    store.migrate().await.expect("migrate after psql");
    let after = schema.query(&recorded).await;
    assert_eq!(
        (before[0].get::<_, i64>(0), before[0].get::<_, String>(1)),
        (after[0].get::<_, i64>(0), after[0].get::<_, String>(1)),
        "migrate() applied something again"
    );
    assert_eq!(after[0].get::<_, i64>(0), store.migrations().len() as i64);

    let (router, counter) = app(IdempotencyLayer::new(store));
    assert_eq!(send(&router, post("k", "{}")).await.status, 201);
    let replay = send(&router, post("k", "{}")).await;
    assert_eq!(replay.outcome, Some(Outcome::Replayed));
    assert_eq!(send(&router, post("k", r#"{"other":1}"#)).await.status, 422);
    assert_eq!(counter.runs(), 1);
}

/// The same for a table in generations: its own table, functions and record.
#[tokio::test]
async fn sql_applied_by_psql_for_a_table_in_generations_passes_verify_and_serves() {
    let schema = TestSchema::new();
    let store = schema
        .unmigrated_store_at(&common::database_url())
        .with_background_purge(None)
        .with_generations(Duration::from_secs(3600));
    psql(&common::database_url(), &store.migration_sql());
    store.verify().await.expect("verify what psql applied");
    store.migrate().await.expect("migrate after psql");
    let (router, counter) = app(IdempotencyLayer::new(store.clone()));
    assert_eq!(send(&router, post("k", "{}")).await.status, 201);
    let replay = send(&router, post("k", "{}")).await;
    assert_eq!(replay.outcome, Some(Outcome::Replayed));
    assert_eq!(send(&router, post("k", r#"{"other":1}"#)).await.status, 422);
    assert_eq!(counter.runs(), 1);
    // A store built without generations finds a partitioned table where it needs a
    // plain one.
    let plain = schema.unmigrated_store_at(&common::database_url());
    let e = plain.verify().await.unwrap_err();
    assert!(
        e.to_string()
            .contains("is a partitioned table, where this store needs a plain one"),
        "{e}"
    );
}

/// A table missing a column fails `verify`, which names the column and what it should
/// be, and changes nothing.
#[tokio::test]
async fn a_table_missing_a_column_fails_verify_naming_it() {
    let schema = TestSchema::new();
    let store = schema.unmigrated_store_at(&common::database_url());
    psql(&common::database_url(), &store.migration_sql());
    schema
        .query(&format!(
            "ALTER TABLE \"{}\".idempotency_keys DROP COLUMN waiters",
            schema.name
        ))
        .await;
    let e = store.verify().await.unwrap_err();
    assert_eq!(e.kind(), StoreErrorKind::Misconfigured);
    let shown = e.to_string();
    assert!(
        shown.contains(&format!(
            "\"{}\".\"idempotency_keys\" is not as this store needs it: column \"waiters\" is missing (this store needs boolean NOT NULL DEFAULT false)",
            schema.name
        )),
        "{shown}"
    );
    // Nothing else is wrong, and nothing was changed.
    assert_eq!(shown.matches("missing").count(), 1, "{shown}");
    let columns = schema
        .query(&format!(
            "SELECT count(*) FROM information_schema.columns WHERE table_schema = '{}' AND column_name = 'waiters'",
            schema.name
        ))
        .await;
    assert_eq!(columns[0].get::<_, i64>(0), 0);
}

/// What else `verify` names: another type, an index missing, the claim's function
/// missing, the holders' table logged (liveness), a migration not recorded, a schema
/// that does not exist.
#[tokio::test]
async fn verify_names_each_difference() {
    let schema = TestSchema::new();
    let store = schema.unmigrated_store_at(&common::database_url());
    let e = store.verify().await.unwrap_err();
    assert!(
        e.to_string()
            .contains(&format!("schema \"{}\" does not exist", schema.name)),
        "{e}"
    );
    let exists = schema
        .query(&format!(
            "SELECT count(*) FROM pg_namespace WHERE nspname = '{}'",
            schema.name
        ))
        .await;
    assert_eq!(exists[0].get::<_, i64>(0), 0, "verify created the schema");

    psql(&common::database_url(), &store.migration_sql());
    let s = &schema.name;
    run(
        &common::database_url(),
        &format!(
            "ALTER TABLE \"{s}\".idempotency_keys ALTER COLUMN status TYPE integer;
             DROP INDEX \"{s}\".idempotency_keys_expires_at;
             DROP FUNCTION \"{s}\".idempotency_keys_claim(text, text, bytea, bigint, bigint, bigint);
             ALTER TABLE \"{s}\".idempotency_keys_holders SET LOGGED;
             DELETE FROM \"{s}\".idempotency_keys_migrations WHERE version = 3",
        ),
    )
    .await;
    let shown = store.verify().await.unwrap_err().to_string();
    for expected in [
        "column \"status\" is integer, where this store needs smallint".to_owned(),
        "an index USING btree (expires_at) is missing".to_owned(),
        format!(
            "function \"{s}\".idempotency_keys_claim(p_scope text, p_key text, p_fingerprint bytea, p_lease_ms bigint, p_ttl_ms bigint, p_token bigint) is missing"
        ),
        format!(
            "\"{s}\".\"idempotency_keys_holders\" is a plain table, where this store needs an unlogged one;"
        ),
        "does not record migration 3".to_owned(),
        "run migrate()".to_owned(),
    ] {
        assert!(shown.contains(&expected), "{expected:?} not in {shown}");
    }
}
