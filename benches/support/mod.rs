//! What the benchmarks share: a database of their own, so that its commit counters
//! count the benchmark alone, and paths taken from the repository's root.

use std::path::{Path, PathBuf};

use tokio_postgres::NoTls;

/// `path` from the repository's root (absolute paths as they are), wherever the
/// benchmark runs: `cargo bench -p benches` runs it in `benches/`, and
/// `BENCH_OUT_DIR=target/bench` means the repository's `target/bench`.
pub(crate) fn in_repository(path: impl AsRef<Path>) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the benchmarks' crate is a directory of the repository")
        .join(path)
}

/// The benchmark database, created if missing (and then dropped by `drop_if_created`),
/// with a connection to the maintenance database `postgres` to manage and observe it.
pub(crate) struct BenchDatabase {
    pub(crate) admin: tokio_postgres::Client,
    pub(crate) name: String,
    created: bool,
}

impl BenchDatabase {
    /// Opens (creating it if needed) the database `url` names; `app` names the admin
    /// connection in `pg_stat_activity`.
    pub(crate) async fn open(url: &str, app: &str) -> Self {
        let config: tokio_postgres::Config = url.parse().expect("BENCH_DATABASE_URL");
        let name = config.get_dbname().unwrap_or("postgres").to_owned();
        assert!(
            name.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'),
            "the benchmark database name must be a-z, 0-9, _"
        );
        // Reading counters from the maintenance database does not count as a
        // transaction of the benchmark database.
        let mut admin_config = config;
        admin_config.dbname("postgres");
        admin_config.application_name(app);
        let (admin, conn) = admin_config.connect(NoTls).await.expect("connect");
        tokio::spawn(conn);
        let exists = admin
            .query_opt("SELECT 1 FROM pg_database WHERE datname = $1", &[&name])
            .await
            .expect("pg_database")
            .is_some();
        if !exists {
            admin
                .batch_execute(&format!("CREATE DATABASE \"{name}\""))
                .await
                .expect("create the benchmark database");
        }
        Self {
            admin,
            name,
            created: !exists,
        }
    }

    /// Drops the database if `open` created it.
    pub(crate) async fn drop_if_created(&self) {
        if self.created {
            self.admin
                .batch_execute(&format!(
                    "DROP DATABASE IF EXISTS \"{}\" WITH (FORCE)",
                    self.name
                ))
                .await
                .expect("drop the benchmark database");
        }
    }
}
