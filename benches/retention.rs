//! Retention: a day's expired rows removed from a large table, by batched `DELETE` (the
//! background purge of a plain table) and by dropping a generation
//! (`PostgresStore::with_generations`), while new keys are claimed.
//!
//! `cargo bench -p benches --bench retention`; the settings are environment variables,
//! described in `docs/benchmarks.md` ("Retention"). Each scheme gets a schema of its own in the
//! benchmark database, holding `RETENTION_ROWS` completed records: half expired (the
//! day that goes), half live (the day that stays); in generations, each half is a
//! generation of its own. Both are loaded first, and claims of new keys measured on
//! each alone, in alternating rounds; then, for each in turn, claims during the
//! retention; the WAL the retention wrote (the window's, less what the claims in it
//! wrote at their rate measured alone); the dead tuples left, and a `VACUUM` of the
//! table (autovacuum is off on the benchmark's tables, so that it is measured here);
//! the table and index sizes before and after. Results are printed as a markdown table and written to
//! `target/bench/retention.csv`.
#![allow(missing_docs)]

mod support;

use std::{
    path::PathBuf,
    str::FromStr,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, StatusCode, header::CONTENT_TYPE};
use sha2::{Digest, Sha256};
use tokio_postgres::NoTls;
use tower_idempotency::{
    Fingerprint, Scope, StoredResponse,
    store::{Claim, ClaimRequest, PostgresStore, Store, pool_for_url},
};

const TENANTS: u64 = 1000;
const LEASE: Duration = Duration::from_secs(30);
const TTL: Duration = Duration::from_secs(24 * 3600);

/// A payment API's answer, about 300 bytes (as in `benches/growth.rs`).
const RESPONSE_BODY: &[u8] = br#"{"id":"pay_3MtwBwLkdIwHu7ix28a3tqPa","object":"payment","amount":1250,"amount_received":1250,"currency":"eur","customer":"cus_NffrFeUfNV2Hib","description":"order 42","status":"succeeded","created":1700000000,"livemode":false,"metadata":{"order_id":"6735"},"payment_method":"pm_1MtwBwLkdIwHu7ixnQQ8OVUL"}"#;

const SCOPE_SQL: &str =
    "'auth:' || encode(sha256(convert_to('tenant-' || (i % 1000), 'UTF8')), 'hex')";
const KEY_SQL: &str = "(SELECT substr(h, 1, 8) || '-' || substr(h, 9, 4) || '-' || substr(h, 13, 4) || '-' || substr(h, 17, 4) || '-' || substr(h, 21, 12)
                        FROM (SELECT encode(sha256(convert_to('{prefix}' || i, 'UTF8')), 'hex') AS h) x)";

struct Settings {
    rows: u64,
    concurrency: usize,
    secs: f64,
    batch: i64,
    chunk: u64,
    pool_size: usize,
    url: String,
    out_dir: PathBuf,
}

fn env_or<T: FromStr>(name: &str, default: T) -> T {
    match std::env::var(name) {
        Ok(v) if !v.trim().is_empty() => v
            .trim()
            .replace('_', "")
            .parse()
            .unwrap_or_else(|_| panic!("{name}={v:?} does not parse")),
        _ => default,
    }
}

impl Settings {
    fn from_env() -> Self {
        Self {
            rows: env_or("RETENTION_ROWS", 1_000_000),
            concurrency: env_or("RETENTION_CONCURRENCY", 8),
            secs: env_or("RETENTION_SECS", 3.0),
            batch: env_or("RETENTION_BATCH", 1000),
            chunk: env_or("RETENTION_LOAD_CHUNK", 500_000),
            pool_size: env_or("RETENTION_POOL_SIZE", 12),
            url: std::env::var("BENCH_DATABASE_URL")
                .ok()
                .filter(|u| !u.is_empty())
                .unwrap_or_else(|| {
                    "postgres://postgres@127.0.0.1:5432/tower_idempotency_bench".to_owned()
                }),
            out_dir: support::in_repository(env_or("BENCH_OUT_DIR", "target/bench".to_owned())),
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Scheme {
    /// A plain table; the expired rows deleted in batches (`purge_expired`), resting
    /// between batches as long as the last took, as the background purge does.
    Delete,
    /// A table in generations; the expired generation emptied and dropped
    /// (`rotate_generations`).
    Generations,
}

impl Scheme {
    fn name(self) -> &'static str {
        match self {
            Self::Delete => "batched DELETE",
            Self::Generations => "generations",
        }
    }

    fn schema(self) -> &'static str {
        match self {
            Self::Delete => "retention_delete",
            Self::Generations => "retention_generations",
        }
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn secs(since: Instant) -> f64 {
    since.elapsed().as_secs_f64()
}

fn percentile(sorted: &[u64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    sorted[i.min(sorted.len() - 1)] as f64 / 1000.0
}

/// Claim latencies in µs, and failures.
#[derive(Default)]
struct Latencies {
    claims: Vec<u64>,
    errors: u64,
}

/// Workers claiming and completing new keys until `stop`.
fn spawn_workers(
    store: &PostgresStore,
    n: usize,
    tag: &str,
    stop: &Arc<AtomicBool>,
) -> Vec<tokio::task::JoinHandle<Latencies>> {
    let mut headers = HeaderMap::new();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    let response = StoredResponse {
        status: StatusCode::CREATED,
        headers,
        body: Bytes::from_static(RESPONSE_BODY),
    };
    (0..n)
        .map(|w| {
            let (store, stop, response) = (store.clone(), stop.clone(), response.clone());
            let tag = format!("{tag}-{w}-");
            tokio::spawn(async move {
                let mut lat = Latencies::default();
                let mut i = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    i += 1;
                    let scope = Scope::new(format!(
                        "auth:{}",
                        hex(&Sha256::digest(
                            format!("tenant-{}", i % TENANTS).as_bytes()
                        ))
                    ));
                    let key = hex(&Sha256::digest(format!("{tag}{i}").as_bytes()));
                    let req = ClaimRequest {
                        scope: &scope,
                        key: &key[..36],
                        fingerprint: Fingerprint::new(Sha256::digest(key.as_bytes()).into()),
                        lease: LEASE,
                        ttl: TTL,
                    };
                    let t = Instant::now();
                    match store.claim(&req).await {
                        Ok(Claim::Acquired(lease)) => {
                            lat.claims.push(t.elapsed().as_micros() as u64);
                            if store.complete(&lease, &response, TTL).await.is_err() {
                                lat.errors += 1;
                            }
                        }
                        _ => lat.errors += 1,
                    }
                }
                lat
            })
        })
        .collect()
}

async fn collect(workers: Vec<tokio::task::JoinHandle<Latencies>>) -> Latencies {
    let mut all = Latencies::default();
    for w in workers {
        let l = w.await.expect("worker");
        all.claims.extend(l.claims);
        all.errors += l.errors;
    }
    all.claims.sort_unstable();
    all
}

struct Db {
    base: support::BenchDatabase,
    client: tokio_postgres::Client,
}

impl Db {
    async fn open(url: &str) -> Self {
        let base = support::BenchDatabase::open(url, "tower_idempotency_retention_admin").await;
        let config: tokio_postgres::Config = url.parse().expect("BENCH_DATABASE_URL");
        let (client, conn) = config.connect(NoTls).await.expect("connect");
        tokio::spawn(conn);
        Self { base, client }
    }

    async fn run(&self, sql: &str) {
        self.client
            .batch_execute(sql)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e:?}"));
    }

    async fn number(&self, sql: &str) -> i64 {
        self.client
            .query_one(sql, &[])
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e:?}"))
            .get(0)
    }

    async fn lsn(&self) -> i64 {
        self.number("SELECT (pg_current_wal_lsn() - '0/0'::pg_lsn)::bigint")
            .await
    }

    /// Heap and index bytes of every table of `schema` but the generations' own.
    async fn bytes(&self, schema: &str) -> (i64, i64) {
        let row = self
            .client
            .query_one(
                "SELECT coalesce(sum(pg_table_size(c.oid)), 0)::bigint,
                        coalesce(sum(pg_indexes_size(c.oid)), 0)::bigint
                 FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                 WHERE n.nspname = $1 AND c.relkind = 'r' AND c.relname LIKE 'idempotency_keys%'
                   AND c.relname NOT IN ('idempotency_keys_migrations', 'idempotency_keys_generations')",
                &[&schema],
            )
            .await
            .expect("sizes");
        (row.get(0), row.get(1))
    }

    /// Dead tuples of the store's tables in `schema`, as the statistics have them.
    async fn dead_tuples(&self, schema: &str) -> i64 {
        self.run("SELECT pg_stat_force_next_flush()").await;
        self.number(&format!(
            "SELECT coalesce(sum(n_dead_tup), 0)::bigint FROM pg_stat_user_tables
             WHERE schemaname = '{schema}' AND relname LIKE 'idempotency_keys%'"
        ))
        .await
    }

    /// Loads rows `from..to` of `prefix` into `table` as completed records, expired over
    /// the last 24 h or expiring over the next, with `generation` if given.
    async fn load(
        &self,
        table: &str,
        prefix: &str,
        rows: (u64, u64),
        chunk: u64,
        expired: bool,
        generation: Option<i64>,
    ) {
        let expires = if expired {
            "now() - random() * interval '24 hours'"
        } else {
            "now() + random() * interval '24 hours'"
        };
        let (gen_col, gen_val) = match generation {
            Some(g) => (", generation".to_owned(), format!(", {g}")),
            None => (String::new(), String::new()),
        };
        let sql = format!(
            "INSERT INTO {table} (scope, key, fingerprint, state, token, locked_until, expires_at,
                                  created_at, completed_at, status, headers, body{gen_col})
             SELECT {SCOPE_SQL}, {key}, sha256(convert_to('fp-' || i, 'UTF8')), 'completed',
                    1 + (random() * 1e15)::bigint, NULL, e, e - interval '24 hours', e - interval '24 hours',
                    201, '\\x0c636f6e74656e742d74797065106170706c69636174696f6e2f6a736f6e'::bytea, $3::bytea{gen_val}
             FROM generate_series($1::bigint, $2::bigint - 1) AS i, LATERAL (SELECT {expires} AS e) ex",
            key = KEY_SQL.replace("{prefix}", prefix),
        );
        let stmt = self.client.prepare(&sql).await.expect("prepare the load");
        let body: &[u8] = RESPONSE_BODY;
        let mut at = rows.0;
        while at < rows.1 {
            let end = (at + chunk).min(rows.1);
            let t = Instant::now();
            self.client
                .execute(&stmt, &[&(at as i64), &(end as i64), &body])
                .await
                .expect("load rows");
            eprintln!(
                "  loaded {} rows into {table} in {:.1} s",
                end - at,
                secs(t)
            );
            at = end;
        }
    }
}

struct Outcome {
    scheme: Scheme,
    removed: i64,
    retention_secs: f64,
    before: Latencies,
    during: Latencies,
    retention_wal: f64,
    dead_tuples: i64,
    vacuum_secs: f64,
    vacuum_wal: i64,
    bytes_before: (i64, i64),
    bytes_after: (i64, i64),
}

async fn prepare(db: &Db, s: &Settings, scheme: Scheme) -> PostgresStore {
    let schema = scheme.schema();
    db.run(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"))
        .await;
    let pool = pool_for_url(&s.url, s.pool_size).expect("pool");
    let mut store = PostgresStore::new(pool)
        .with_schema_name(schema)
        .expect("schema")
        .with_background_purge(None);
    if scheme == Scheme::Generations {
        store = store.with_generations(Duration::from_secs(24 * 3600));
    }
    store.migrate().await.expect("migrate");
    let half = s.rows / 2;
    let t = format!("{schema}.idempotency_keys");
    match scheme {
        Scheme::Delete => {
            db.run(&format!("ALTER TABLE {t} SET (autovacuum_enabled = false)"))
                .await;
            // Loaded without its indexes, which are then built in bulk.
            db.run(&format!(
                "ALTER TABLE {t} DROP CONSTRAINT idempotency_keys_pkey; DROP INDEX {schema}.idempotency_keys_expires_at"
            ))
            .await;
            db.load(&t, "old-", (0, half), s.chunk, true, None).await;
            db.load(&t, "new-", (half, s.rows), s.chunk, false, None)
                .await;
            let b = Instant::now();
            db.run(&format!(
                "ALTER TABLE {t} ADD PRIMARY KEY (scope, key);
                 CREATE INDEX idempotency_keys_expires_at ON {t} (expires_at)"
            ))
            .await;
            eprintln!("  built the indexes in {:.1} s", secs(b));
        }
        Scheme::Generations => {
            // Generations 1 (yesterday's, expired) and 2 (today's) loaded as tables of
            // their own, then attached (which builds their indexes in bulk); new keys go
            // to generation 3.
            db.run(&format!(
                "ALTER TABLE {t} DETACH PARTITION {t}_g1; DROP TABLE {t}_g1;
                 INSERT INTO {t}_generations (generation, started_at) VALUES
                     (2, now() - interval '1 hour'), (3, now());
                 UPDATE {t}_generations SET started_at = now() - interval '25 hours' WHERE generation = 1"
            ))
            .await;
            for (g, prefix, rows, expired) in [
                (1, "old-", (0, half), true),
                (2, "new-", (half, s.rows), false),
            ] {
                let part = format!("{t}_g{g}");
                db.run(&format!(
                    "CREATE TABLE {part} (LIKE {t} INCLUDING DEFAULTS INCLUDING CONSTRAINTS)
                     WITH (autovacuum_enabled = false)"
                ))
                .await;
                db.load(&part, prefix, rows, s.chunk, expired, Some(g))
                    .await;
                let b = Instant::now();
                db.run(&format!(
                    "ALTER TABLE {t} ATTACH PARTITION {part} FOR VALUES IN ({g})"
                ))
                .await;
                eprintln!("  attached generation {g} in {:.1} s", secs(b));
            }
            db.run(&format!(
                "CREATE TABLE {t}_g3 (LIKE {t} INCLUDING DEFAULTS INCLUDING CONSTRAINTS)
                     WITH (autovacuum_enabled = false);
                 ALTER TABLE {t} ATTACH PARTITION {t}_g3 FOR VALUES IN (3)"
            ))
            .await;
        }
    }
    db.run(&format!("VACUUM (ANALYZE) {t}")).await;
    store
}

/// A scheme's table, loaded: its store, and what it held before the retention.
struct Loaded {
    scheme: Scheme,
    store: PostgresStore,
    bytes_before: (i64, i64),
    expired_rows: i64,
    /// Claims measured before the retention, and the WAL they wrote.
    before: Latencies,
    before_wal: i64,
}

async fn load_scheme(db: &Db, s: &Settings, scheme: Scheme) -> Loaded {
    eprintln!("{}: loading {} rows ...", scheme.name(), s.rows);
    let store = prepare(db, s, scheme).await;
    let t = format!("{}.idempotency_keys", scheme.schema());
    let bytes_before = db.bytes(scheme.schema()).await;
    let expired_rows = db
        .number(&format!(
            "SELECT count(*) FROM {t} WHERE expires_at <= now()"
        ))
        .await;
    Loaded {
        scheme,
        store,
        bytes_before,
        expired_rows,
        before: Latencies::default(),
        before_wal: 0,
    }
}

/// Claims on `loaded`'s table alone for `secs`: their latency, and the WAL they wrote.
async fn claims_alone(db: &Db, s: &Settings, loaded: &mut Loaded, round: usize, secs: f64) {
    let stop = Arc::new(AtomicBool::new(false));
    let lsn = db.lsn().await;
    let tag = format!("before{round}");
    let workers = spawn_workers(&loaded.store, s.concurrency, &tag, &stop);
    tokio::time::sleep(Duration::from_secs_f64(secs)).await;
    stop.store(true, Ordering::Relaxed);
    let lat = collect(workers).await;
    loaded.before_wal += db.lsn().await - lsn;
    loaded.before.claims.extend(lat.claims);
    loaded.before.errors += lat.errors;
    loaded.before.claims.sort_unstable();
}

async fn retain(db: &Db, s: &Settings, loaded: Loaded) -> Outcome {
    let Loaded {
        scheme,
        store,
        bytes_before,
        expired_rows,
        before,
        before_wal,
    } = loaded;
    let schema = scheme.schema();
    let t = format!("{schema}.idempotency_keys");
    let wal_per_claim = before_wal as f64 / before.claims.len().max(1) as f64;

    // The retention, while claims run.
    db.run("CHECKPOINT").await;
    let stop = Arc::new(AtomicBool::new(false));
    let lsn = db.lsn().await;
    let workers = spawn_workers(&store, s.concurrency, "during", &stop);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let started = Instant::now();
    match scheme {
        Scheme::Delete => loop {
            let b = Instant::now();
            let n = store.purge_expired(s.batch).await.expect("purge");
            if n < s.batch as u64 {
                break;
            }
            tokio::time::sleep(b.elapsed()).await;
        },
        Scheme::Generations => {
            let rotation = store.rotate_generations().await.expect("rotate");
            assert_eq!(rotation.dropped, [1], "{rotation:?}");
        }
    }
    let retention_secs = secs(started);
    tokio::time::sleep(Duration::from_millis(200)).await;
    stop.store(true, Ordering::Relaxed);
    let during = collect(workers).await;
    let window_wal = (db.lsn().await - lsn) as f64;
    let retention_wal = window_wal - wal_per_claim * during.claims.len() as f64;
    let left = db
        .number(&format!(
            "SELECT count(*) FROM {t} WHERE expires_at <= now()"
        ))
        .await;

    // The vacuum work left behind.
    let dead_tuples = db.dead_tuples(schema).await;
    let lsn = db.lsn().await;
    let v = Instant::now();
    db.run(&format!("VACUUM {t}")).await;
    let vacuum_secs = secs(v);
    let vacuum_wal = db.lsn().await - lsn;
    let bytes_after = db.bytes(schema).await;
    store.pool().close();
    Outcome {
        scheme,
        removed: expired_rows - left,
        retention_secs,
        before,
        during,
        retention_wal,
        dead_tuples,
        vacuum_secs,
        vacuum_wal,
        bytes_before,
        bytes_after,
    }
}

fn mib(b: f64) -> String {
    format!("{:.1}", b / (1024.0 * 1024.0))
}

fn main() {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
        .block_on(run());
}

async fn run() {
    let s = Settings::from_env();
    let db = Db::open(&s.url).await;
    let mut loaded = Vec::new();
    for scheme in [Scheme::Delete, Scheme::Generations] {
        loaded.push(load_scheme(&db, &s, scheme).await);
    }
    // Claims alone, on each table in turn, in rounds: the two compared under the same
    // conditions (the machine's other load, the page cache holding both tables).
    db.run("CHECKPOINT").await;
    const ROUNDS: usize = 4;
    for round in 0..ROUNDS {
        for l in &mut loaded {
            claims_alone(&db, &s, l, round, s.secs / ROUNDS as f64).await;
        }
    }
    let mut outcomes = Vec::new();
    for l in loaded {
        let scheme = l.scheme;
        outcomes.push(retain(&db, &s, l).await);
        let drop = format!("DROP SCHEMA IF EXISTS {} CASCADE", scheme.schema());
        db.run(&drop).await;
    }
    println!(
        "\n### Retention of {} expired rows out of {} (claims of new keys, c = {})\n",
        s.rows / 2,
        s.rows,
        s.concurrency
    );
    let header = [
        "scheme",
        "rows removed",
        "retention s",
        "claim p50 ms before",
        "p99 before",
        "p50 during",
        "p99 during",
        "claims failed",
        "retention WAL MiB",
        "dead tuples",
        "VACUUM s",
        "VACUUM WAL MiB",
        "table + indexes MiB before",
        "after",
    ];
    println!("| {} |", header.join(" | "));
    println!(
        "|{}|",
        header.iter().map(|_| "---").collect::<Vec<_>>().join("|")
    );
    let mut csv = format!("{}\n", header.join(","));
    for o in &outcomes {
        let cells = [
            o.scheme.name().to_owned(),
            o.removed.to_string(),
            format!("{:.2}", o.retention_secs),
            format!("{:.2}", percentile(&o.before.claims, 0.5)),
            format!("{:.2}", percentile(&o.before.claims, 0.99)),
            format!("{:.2}", percentile(&o.during.claims, 0.5)),
            format!("{:.2}", percentile(&o.during.claims, 0.99)),
            (o.before.errors + o.during.errors).to_string(),
            mib(o.retention_wal.max(0.0)),
            o.dead_tuples.to_string(),
            format!("{:.2}", o.vacuum_secs),
            mib(o.vacuum_wal as f64),
            format!(
                "{} + {}",
                mib(o.bytes_before.0 as f64),
                mib(o.bytes_before.1 as f64)
            ),
            format!(
                "{} + {}",
                mib(o.bytes_after.0 as f64),
                mib(o.bytes_after.1 as f64)
            ),
        ];
        println!("| {} |", cells.join(" | "));
        csv.push_str(&cells.join(","));
        csv.push('\n');
    }
    std::fs::create_dir_all(&s.out_dir).expect("out dir");
    let path = s.out_dir.join("retention.csv");
    std::fs::write(&path, csv).expect("csv");
    eprintln!("written {}", path.display());
    db.base.drop_if_created().await;
}
