//! Growth: claim, completion and replay latency as the table grows (0, 1 M, 10 M rows),
//! and a purge of expired rows in batches while claims run.
//!
//! `cargo bench -p benches --bench growth`; the settings are environment variables,
//! described in `docs/benchmarks.md`. The results are printed as markdown tables and
//! written to `target/bench/growth.csv`.
//!
//! Rows are bulk-loaded with `INSERT … SELECT generate_series` straight into the
//! store's table: completed records of realistic size (a 69-character scope among 1000
//! tenants, a UUID key, a 32-byte fingerprint, stored headers and a 300-byte JSON body),
//! `expires_at` spread over the next 24 h. The claims and replays go through
//! `PostgresStore` (the `Store` trait), with UUID keys in random places of the index.
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
    store::{Claim, ClaimRequest, Fenced, PostgresStore, Store, pool_for_url},
};

const TENANTS: u64 = 1000;
const LEASE: Duration = Duration::from_secs(30);
const TTL: Duration = Duration::from_secs(24 * 3600);

/// A payment API's answer, about 300 bytes.
const RESPONSE_BODY: &[u8] = br#"{"id":"pay_3MtwBwLkdIwHu7ix28a3tqPa","object":"payment","amount":1250,"amount_received":1250,"currency":"eur","customer":"cus_NffrFeUfNV2Hib","description":"order 42","status":"succeeded","created":1700000000,"livemode":false,"metadata":{"order_id":"6735"},"payment_method":"pm_1MtwBwLkdIwHu7ixnQQ8OVUL"}"#;

struct Settings {
    sizes: Vec<u64>,
    secs: f64,
    warmup: f64,
    concurrency: Vec<usize>,
    pool_size: usize,
    chunk: u64,
    purge_rows: u64,
    purge_batch: i64,
    purge_concurrency: usize,
    url: String,
    out_dir: PathBuf,
}

fn env_or<T: FromStr>(name: &str, default: T) -> T {
    match std::env::var(name) {
        Ok(v) if !v.trim().is_empty() => v
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("{name}={v:?} does not parse")),
        _ => default,
    }
}

fn env_numbers<T: FromStr>(name: &str, default: Vec<T>) -> Vec<T> {
    match std::env::var(name) {
        Ok(v) if !v.trim().is_empty() => v
            .split(',')
            .map(|x| {
                x.trim()
                    .replace('_', "")
                    .parse()
                    .unwrap_or_else(|_| panic!("{name}: {x:?} is not a number"))
            })
            .collect(),
        _ => default,
    }
}

impl Settings {
    fn from_env() -> Self {
        let mut sizes = env_numbers("GROWTH_ROWS", vec![0, 1_000_000, 10_000_000]);
        sizes.sort_unstable();
        Self {
            sizes,
            secs: env_or("GROWTH_SECS", 3.0),
            warmup: env_or("GROWTH_WARMUP_SECS", 0.5),
            concurrency: env_numbers("GROWTH_CONCURRENCY", vec![1, 16]),
            pool_size: env_or("GROWTH_POOL_SIZE", 16),
            chunk: env_or("GROWTH_LOAD_CHUNK", 1_000_000),
            purge_rows: env_or("GROWTH_PURGE_ROWS", 1_000_000),
            purge_batch: env_or("GROWTH_PURGE_BATCH", 1000),
            purge_concurrency: env_or("GROWTH_PURGE_CONCURRENCY", 16),
            url: env_or(
                "BENCH_DATABASE_URL",
                "postgres://postgres@127.0.0.1:5432/tower_idempotency_bench".to_owned(),
            ),
            out_dir: support::in_repository(env_or("BENCH_OUT_DIR", "target/bench".to_owned())),
        }
    }
}

// ---------------------------------------------------------------------------------------
// Keys: the same in SQL (bulk load) and in Rust (replays).
// ---------------------------------------------------------------------------------------

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// `auth:` and a SHA-256, as `Scope::from_authorization` makes them.
fn tenant_scope(tenant: u64) -> Scope {
    Scope::new(format!(
        "auth:{}",
        hex(&Sha256::digest(format!("tenant-{tenant}").as_bytes()))
    ))
}

const SCOPE_SQL: &str =
    "'auth:' || encode(sha256(convert_to('tenant-' || (i % 1000), 'UTF8')), 'hex')";

/// A UUID-shaped key from a SHA-256 of `seed`.
fn uuid_key(seed: &str) -> String {
    let h = hex(&Sha256::digest(seed.as_bytes()));
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

const KEY_SQL: &str = "(SELECT substr(h, 1, 8) || '-' || substr(h, 9, 4) || '-' || substr(h, 13, 4) || '-' || substr(h, 17, 4) || '-' || substr(h, 21, 12)
                        FROM (SELECT encode(sha256(convert_to('{prefix}' || i, 'UTF8')), 'hex') AS h) x)";

/// The label of the plain primary-key reads measured beside the replays.
const PK_READ: &str = "SELECT by primary key";

fn loaded_key(prefix: &str, i: u64) -> String {
    uuid_key(&format!("{prefix}{i}"))
}

/// A small xorshift generator: enough to pick rows at random.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

// ---------------------------------------------------------------------------------------
// The database
// ---------------------------------------------------------------------------------------

struct Db {
    base: support::BenchDatabase,
    client: tokio_postgres::Client,
}

impl Db {
    async fn open(url: &str) -> Self {
        let base = support::BenchDatabase::open(url, "tower_idempotency_growth_admin").await;
        let config: tokio_postgres::Config = url.parse().expect("BENCH_DATABASE_URL");
        let (client, conn) = config.connect(NoTls).await.expect("connect");
        tokio::spawn(conn);
        Self { base, client }
    }
}

fn secs(since: Instant) -> f64 {
    since.elapsed().as_secs_f64()
}

#[allow(clippy::too_many_arguments)]
/// Loads rows `from..to` as completed records: live ones expire over the next 24 h,
/// expired ones expired over the last 24 h.
async fn load(
    db: &Db,
    table: &str,
    prefix: &str,
    from: u64,
    to: u64,
    chunk: u64,
    expired: bool,
    headers: &[u8],
) {
    let expires = if expired {
        "now() - random() * interval '24 hours'"
    } else {
        "now() + random() * interval '24 hours'"
    };
    let sql = format!(
        "INSERT INTO {table} (scope, key, fingerprint, state, token, locked_until, expires_at,
                              created_at, completed_at, status, headers, body)
         SELECT {scope}, {key}, sha256(convert_to('fp-' || i, 'UTF8')), 'completed',
                1 + (random() * 1e15)::bigint, NULL, e, e - interval '24 hours', e - interval '24 hours',
                201, $3::bytea, $4::bytea
         FROM generate_series($1::bigint, $2::bigint - 1) AS i, LATERAL (SELECT {expires} AS e) ex",
        scope = SCOPE_SQL,
        key = KEY_SQL.replace("{prefix}", prefix),
    );
    let stmt = db.client.prepare(&sql).await.expect("prepare the load");
    let body: &[u8] = RESPONSE_BODY;
    let mut at = from;
    while at < to {
        let end = (at + chunk).min(to);
        let t = Instant::now();
        let (a, b) = (at as i64, end as i64);
        db.client
            .execute(&stmt, &[&a, &b, &headers, &body])
            .await
            .expect("load rows");
        eprintln!(
            "  loaded {prefix}{at}..{end} ({} rows) in {:.1} s",
            end - at,
            secs(t)
        );
        at = end;
    }
}

/// The table's primary key and indexes, dropped before a bulk load and rebuilt after it
/// (far faster than maintaining them row by row).
async fn without_indexes<F: Future<Output = ()>>(db: &Db, table: &str, work: F) {
    let rows = db
        .client
        .query(
            "SELECT conname::text, pg_get_constraintdef(oid) FROM pg_constraint
             WHERE conrelid = $1::text::regclass AND contype = 'p'",
            &[&table],
        )
        .await
        .expect("pg_constraint");
    let pk: Vec<(String, String)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    let rows = db
        .client
        .query(
            "SELECT i.indexrelid::regclass::text, pg_get_indexdef(i.indexrelid) FROM pg_index i
             WHERE i.indrelid = $1::text::regclass AND NOT i.indisprimary",
            &[&table],
        )
        .await
        .expect("pg_index");
    let indexes: Vec<(String, String)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    for (name, _) in &pk {
        db.client
            .batch_execute(&format!("ALTER TABLE {table} DROP CONSTRAINT \"{name}\""))
            .await
            .expect("drop the primary key");
    }
    for (name, _) in &indexes {
        db.client
            .batch_execute(&format!("DROP INDEX {name}"))
            .await
            .expect("drop an index");
    }
    work.await;
    let t = Instant::now();
    for (name, def) in &pk {
        db.client
            .batch_execute(&format!(
                "ALTER TABLE {table} ADD CONSTRAINT \"{name}\" {def}"
            ))
            .await
            .expect("rebuild the primary key");
    }
    for (_, def) in &indexes {
        db.client
            .batch_execute(def)
            .await
            .expect("rebuild an index");
    }
    eprintln!("  rebuilt the primary key and indexes in {:.1} s", secs(t));
}

async fn vacuum(db: &Db, table: &str) {
    let t = Instant::now();
    db.client
        .batch_execute(&format!("VACUUM (ANALYZE) {table}"))
        .await
        .expect("vacuum");
    eprintln!("  VACUUM (ANALYZE) in {:.1} s", secs(t));
}

async fn sizes(db: &Db, table: &str) -> (i64, String, String) {
    let row = db
        .client
        .query_one(
            &format!(
                "SELECT count(*), pg_size_pretty(pg_table_size('{t}')), pg_size_pretty(pg_indexes_size('{t}')) FROM {table}",
                t = table.replace('\'', "''")
            ),
            &[],
        )
        .await
        .expect("sizes");
    (row.get(0), row.get(1), row.get(2))
}

// ---------------------------------------------------------------------------------------
// The load
// ---------------------------------------------------------------------------------------

#[derive(Clone, Copy, PartialEq, Eq)]
enum Work {
    /// A new key: the claim, then the completion.
    NewKeys,
    /// A completed key, picked at random among `n`.
    Replays { n: u64, prefix: &'static str },
    /// The same keys read by a plain `SELECT` by primary key, not claimed: the floor
    /// the replays are compared with.
    Reads { n: u64, prefix: &'static str },
}

#[derive(Default)]
struct Latencies {
    claims: Vec<u64>,
    completions: Vec<u64>,
    errors: u64,
}

impl Latencies {
    fn merge(&mut self, other: Latencies) {
        self.claims.extend(other.claims);
        self.completions.extend(other.completions);
        self.errors += other.errors;
    }

    fn sort(&mut self) {
        self.claims.sort_unstable();
        self.completions.sort_unstable();
    }
}

fn percentile(sorted: &[u64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1] as f64 / 1e6
}

struct Ctx {
    store: PostgresStore,
    /// A plain read of a stored response by primary key (the e2e benchmark's j′).
    select: String,
    scopes: Arc<Vec<Scope>>,
    fingerprint: Fingerprint,
    response: StoredResponse,
}

/// `c` workers doing `work` back to back; latencies recorded while `measuring` is set,
/// until `stop` is set.
fn spawn_workers(
    ctx: &Arc<Ctx>,
    c: usize,
    work: Work,
    tag: &str,
    measuring: &Arc<AtomicBool>,
    stop: &Arc<AtomicBool>,
) -> Vec<tokio::task::JoinHandle<Latencies>> {
    (0..c)
        .map(|w| {
            let (ctx, measuring, stop) = (ctx.clone(), measuring.clone(), stop.clone());
            let tag = format!("{tag}-w{w}");
            tokio::spawn(async move {
                // Seeded by the measurement too: the reads must not follow the replays
                // just before them to keys whose pages those replays brought in.
                let salt = tag.bytes().fold(0xCBF2_9CE4_8422_2325u64, |h, b| {
                    (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01B3)
                });
                let mut rng =
                    Rng(0x9E37_79B9_7F4A_7C15 ^ ((w as u64 + 1) * 0x2545_F491_4F6C_DD1D) ^ salt);
                let mut lat = Latencies::default();
                let mut seq = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    seq += 1;
                    let (scope, key, fingerprint) = match work {
                        Work::NewKeys => (
                            ctx.scopes[rng.below(TENANTS) as usize].clone(),
                            uuid_key(&format!("{tag}-{seq}")),
                            ctx.fingerprint,
                        ),
                        Work::Replays { n, prefix } | Work::Reads { n, prefix } => {
                            let i = rng.below(n);
                            (
                                ctx.scopes[(i % TENANTS) as usize].clone(),
                                loaded_key(prefix, i),
                                ctx.fingerprint,
                            )
                        }
                    };
                    let request = ClaimRequest {
                        scope: &scope,
                        key: &key,
                        fingerprint,
                        lease: LEASE,
                        ttl: TTL,
                    };
                    let record = measuring.load(Ordering::Relaxed);
                    let t = Instant::now();
                    if let Work::Reads { .. } = work {
                        let read = read_completed(&ctx, &scope, &key).await;
                        let took = t.elapsed().as_nanos() as u64;
                        match read {
                            Ok(true) if record => lat.claims.push(took),
                            Ok(true) => {}
                            _ => lat.errors += 1,
                        }
                        continue;
                    }
                    let claim = ctx.store.claim(&request).await;
                    let claimed = t.elapsed().as_nanos() as u64;
                    match (work, claim) {
                        (Work::NewKeys, Ok(Claim::Acquired(lease))) => {
                            let t = Instant::now();
                            let done = ctx.store.complete(&lease, &ctx.response, TTL).await;
                            let completed = t.elapsed().as_nanos() as u64;
                            match done {
                                Ok(Fenced::Kept) if record => {
                                    lat.claims.push(claimed);
                                    lat.completions.push(completed);
                                }
                                Ok(Fenced::Kept) => {}
                                _ => lat.errors += 1,
                            }
                        }
                        (Work::Replays { .. }, Ok(Claim::Completed { .. })) => {
                            if record {
                                lat.claims.push(claimed);
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
        all.merge(w.await.expect("worker"));
    }
    all.sort();
    all
}

/// Warm-up, then `secs` measured.
async fn measure(
    ctx: &Arc<Ctx>,
    c: usize,
    work: Work,
    tag: &str,
    s: &Settings,
) -> (Latencies, f64) {
    let measuring = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let workers = spawn_workers(ctx, c, work, tag, &measuring, &stop);
    tokio::time::sleep(Duration::from_secs_f64(s.warmup)).await;
    measuring.store(true, Ordering::Relaxed);
    let t = Instant::now();
    tokio::time::sleep(Duration::from_secs_f64(s.secs)).await;
    measuring.store(false, Ordering::Relaxed);
    let window = secs(t);
    stop.store(true, Ordering::Relaxed);
    (collect(workers).await, window)
}

struct Row {
    table_rows: i64,
    test: String,
    concurrency: usize,
    ops: usize,
    ops_per_s: f64,
    p50_ms: f64,
    p99_ms: f64,
    errors: u64,
}

/// Whether the row for `key` is there and completed, read by primary key.
async fn read_completed(ctx: &Ctx, scope: &Scope, key: &str) -> Result<bool, String> {
    let client = ctx.store.pool().get().await.map_err(|e| e.to_string())?;
    let stmt = client
        .prepare_cached(&ctx.select)
        .await
        .map_err(|e| e.to_string())?;
    let row = client
        .query_opt(&stmt, &[&scope.as_str(), &key])
        .await
        .map_err(|e| e.to_string())?;
    Ok(row.is_some_and(|r| r.get::<_, &str>("state") == "completed"))
}

fn rows_of(table_rows: i64, test: &str, c: usize, lat: &Latencies, window: f64) -> Vec<Row> {
    rows_named(table_rows, test, "claim", c, lat, window)
}

/// The rows of one measurement: `{test}: {what}` for the first call of each operation,
/// and `{test}: completion` when there were completions.
fn rows_named(
    table_rows: i64,
    test: &str,
    what: &str,
    c: usize,
    lat: &Latencies,
    window: f64,
) -> Vec<Row> {
    let mut rows = vec![Row {
        table_rows,
        test: format!("{test}: {what}"),
        concurrency: c,
        ops: lat.claims.len(),
        ops_per_s: lat.claims.len() as f64 / window,
        p50_ms: percentile(&lat.claims, 0.5),
        p99_ms: percentile(&lat.claims, 0.99),
        errors: lat.errors,
    }];
    if !lat.completions.is_empty() {
        rows.push(Row {
            table_rows,
            test: format!("{test}: completion"),
            concurrency: c,
            ops: lat.completions.len(),
            ops_per_s: lat.completions.len() as f64 / window,
            p50_ms: percentile(&lat.completions, 0.5),
            p99_ms: percentile(&lat.completions, 0.99),
            errors: lat.errors,
        });
    }
    rows
}

fn print_rows(rows: &[Row]) {
    println!("| rows in table | test | c | ops/s | p50 ms | p99 ms | errors |");
    println!("|---:|---|---:|---:|---:|---:|---:|");
    for r in rows {
        println!(
            "| {} | {} | {} | {:.0} | {:.2} | {:.2} | {} |",
            r.table_rows, r.test, r.concurrency, r.ops_per_s, r.p50_ms, r.p99_ms, r.errors
        );
    }
}

fn write_csv(rows: &[Row], path: &PathBuf) {
    let mut out = String::from("table_rows,test,concurrency,ops,ops_per_s,p50_ms,p99_ms,errors\n");
    for r in rows {
        out.push_str(&format!(
            "{},\"{}\",{},{},{:.1},{:.4},{:.4},{}\n",
            r.table_rows, r.test, r.concurrency, r.ops, r.ops_per_s, r.p50_ms, r.p99_ms, r.errors
        ));
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).expect("create the output directory");
    }
    std::fs::write(path, out).expect("write the CSV");
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(run());
}

async fn run() {
    let s = Settings::from_env();
    let db = Db::open(&s.url).await;
    db.client
        .batch_execute("SET maintenance_work_mem = '1GB'; SET synchronous_commit = off")
        .await
        .expect("session settings");
    let schema = format!(
        "growth_{}_{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs())
    );
    let store = PostgresStore::new(pool_for_url(&s.url, s.pool_size).expect("pool"))
        .with_schema_name(&schema)
        .expect("schema name");
    store.migrate().await.expect("migrate");
    let table = store.table().to_owned();
    eprintln!("schema {schema}, table {table}");

    let mut h = HeaderMap::new();
    h.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    h.insert(
        "location",
        HeaderValue::from_static("/payments/pay_3MtwBwLkdIwHu7ix28a3tqPa"),
    );
    let headers = StoredResponse::encode_headers(&h);
    let ctx = Arc::new(Ctx {
        store: store.clone(),
        select: format!(
            "SELECT token, fingerprint, state, status, headers, body FROM {table} WHERE scope = $1 AND key = $2"
        ),
        scopes: Arc::new((0..TENANTS).map(tenant_scope).collect()),
        fingerprint: Fingerprint::new(Sha256::digest(b"POST /payments").into()),
        response: StoredResponse {
            status: StatusCode::CREATED,
            headers: h,
            body: Bytes::from_static(RESPONSE_BODY),
        },
    });

    let mut results: Vec<Row> = Vec::new();
    let mut loaded = 0u64;
    for &size in &s.sizes {
        if size > loaded {
            eprintln!("loading rows {loaded}..{size} ...");
            let t = Instant::now();
            without_indexes(
                &db,
                &table,
                load(&db, &table, "key-", loaded, size, s.chunk, false, &headers),
            )
            .await;
            vacuum(&db, &table).await;
            eprintln!("  {} rows loaded in {:.1} s", size - loaded, secs(t));
            loaded = size;
        }
        let (count, heap, index) = sizes(&db, &table).await;
        eprintln!("table: {count} rows, heap {heap}, indexes {index}");
        for &c in &s.concurrency {
            let first = results.len();
            let (lat, window) =
                measure(&ctx, c, Work::NewKeys, &format!("new-{size}-c{c}"), &s).await;
            results.extend(rows_of(size as i64, "new keys", c, &lat, window));
            // Replays: loaded rows at random; on an empty table, the keys just created
            // cannot be named again cheaply, so replay the first loaded size's rows only.
            if loaded > 0 {
                let work = Work::Replays {
                    n: loaded,
                    prefix: "key-",
                };
                let (lat, window) =
                    measure(&ctx, c, work, &format!("replay-{size}-c{c}"), &s).await;
                results.extend(rows_of(size as i64, "replays", c, &lat, window));
                let work = Work::Reads {
                    n: loaded,
                    prefix: "key-",
                };
                let (lat, window) = measure(&ctx, c, work, &format!("read-{size}-c{c}"), &s).await;
                results.extend(rows_named(size as i64, "replays", PK_READ, c, &lat, window));
            }
            for r in &results[first..] {
                eprintln!(
                    "  {:>10} rows  {:<22} c={:<3} {:>7.0} ops/s  p50 {:.2} ms  p99 {:.2} ms  errors {}",
                    r.table_rows, r.test, r.concurrency, r.ops_per_s, r.p50_ms, r.p99_ms, r.errors
                );
            }
        }
        if loaded == 0 && size == 0 {
            // Replays on the empty table: a small set of completed keys, loaded the same way.
            load(&db, &table, "small-", 0, 1000, 1000, false, &headers).await;
            vacuum(&db, &table).await;
            for &c in &s.concurrency {
                let work = Work::Replays {
                    n: 1000,
                    prefix: "small-",
                };
                let (lat, window) = measure(&ctx, c, work, &format!("replay-0-c{c}"), &s).await;
                results.extend(rows_of(0, "replays", c, &lat, window));
                let work = Work::Reads {
                    n: 1000,
                    prefix: "small-",
                };
                let (lat, window) = measure(&ctx, c, work, &format!("read-0-c{c}"), &s).await;
                results.extend(rows_named(0, "replays", PK_READ, c, &lat, window));
                for r in &results[results.len() - 2..] {
                    eprintln!(
                        "  {:>10} rows  {:<22} c={:<3} {:>7.0} ops/s  p50 {:.2} ms  p99 {:.2} ms",
                        0, r.test, r.concurrency, r.ops_per_s, r.p50_ms, r.p99_ms
                    );
                }
            }
        }
    }

    // The purge: expired rows, deleted in batches by a purger of its own (another pool,
    // as another replica would be) while claims run.
    let mut purge_rows: Vec<Row> = Vec::new();
    let mut purge_summary = String::new();
    if s.purge_rows > 0 {
        eprintln!("loading {} expired rows ...", s.purge_rows);
        let t = Instant::now();
        without_indexes(
            &db,
            &table,
            load(
                &db,
                &table,
                "expired-",
                0,
                s.purge_rows,
                s.chunk,
                true,
                &headers,
            ),
        )
        .await;
        vacuum(&db, &table).await;
        eprintln!("  loaded in {:.1} s", secs(t));
        let (count, heap, index) = sizes(&db, &table).await;
        eprintln!("table: {count} rows, heap {heap}, indexes {index}");
        let c = s.purge_concurrency;
        let base = count;

        let (before, window) = measure(&ctx, c, Work::NewKeys, "purge-before", &s).await;
        purge_rows.extend(rows_of(base, "before the purge", c, &before, window));

        let purger = PostgresStore::new(pool_for_url(&s.url, 2).expect("pool"))
            .with_schema_name(&schema)
            .expect("schema name");
        let measuring = Arc::new(AtomicBool::new(false));
        let stop = Arc::new(AtomicBool::new(false));
        let workers = spawn_workers(&ctx, c, Work::NewKeys, "purge-during", &measuring, &stop);
        tokio::time::sleep(Duration::from_secs_f64(s.warmup)).await;
        measuring.store(true, Ordering::Relaxed);
        let t = Instant::now();
        let mut purged = 0u64;
        let mut batches = 0u64;
        let mut batch_ms: Vec<u64> = Vec::new();
        loop {
            let b = Instant::now();
            let n = purger.purge_expired(s.purge_batch).await.expect("purge");
            batch_ms.push(b.elapsed().as_nanos() as u64);
            purged += n;
            batches += 1;
            if n < s.purge_batch as u64 {
                break;
            }
        }
        let purge_secs = secs(t);
        measuring.store(false, Ordering::Relaxed);
        stop.store(true, Ordering::Relaxed);
        let during = collect(workers).await;
        batch_ms.sort_unstable();
        purge_rows.extend(rows_of(base, "during the purge", c, &during, purge_secs));

        let (after, window) = measure(&ctx, c, Work::NewKeys, "purge-after", &s).await;
        purge_rows.extend(rows_of(base, "after the purge", c, &after, window));
        purge_summary = format!(
            "purged {purged} rows in {batches} batches of {} in {:.1} s ({:.0} rows/s); batch p50 {:.1} ms, p99 {:.1} ms",
            s.purge_batch,
            purge_secs,
            purged as f64 / purge_secs,
            percentile(&batch_ms, 0.5),
            percentile(&batch_ms, 0.99),
        );
        eprintln!("{purge_summary}");
        purger.pool().close();
    }

    println!("\n### Latency by table size\n");
    print_rows(&results);
    if !purge_rows.is_empty() {
        println!("\n### Claims during a purge\n");
        print_rows(&purge_rows);
        println!("\n{purge_summary}");
    }
    let mut all = results;
    all.extend(purge_rows);
    let csv = s.out_dir.join("growth.csv");
    write_csv(&all, &csv);
    eprintln!("\nwrote {}", csv.display());

    store.pool().close();
    db.client
        .batch_execute(&format!("DROP SCHEMA \"{schema}\" CASCADE"))
        .await
        .expect("drop the schema");
    drop(db.client);
    db.base.drop_if_created().await;
}
