//! Remembered keys (`remember_keys_for`): what a key costs once its response is gone,
//! in bytes, and what 10⁷ of them cost the claims of new keys.
//!
//! `cargo bench -p benches --bench remembered`. Two tables in the benchmark database
//! (`BENCH_DATABASE_URL`, created and dropped if missing), each in a schema of its own:
//! one empty, one holding `REMEMBERED_ROWS` (10⁷) remembered rows, as the purge leaves
//! them (completed, no headers or body, forgotten in 7 days), over 1 000 tenants. Then,
//! in `REMEMBERED_ROUNDS` alternating rounds of `REMEMBERED_CLAIMS` claims each, one at
//! a time: claims of new keys on each table, late retries (claims of a remembered key,
//! answered `Remembered`) on the full one, and replays (claims of a completed key) on
//! the empty one. Printed: bytes per remembered row (`pg_column_size` of the row, and
//! the heap and primary-key index per row), the same for a completed row with a 300-byte
//! body, and claim latencies with their ratios within the run, also written to
//! `target/bench/remembered.md` (`BENCH_OUT_DIR`). Both schemas are dropped at the end
//! (`REMEMBERED_KEEP=1` keeps them).
#![allow(missing_docs)]

mod support;

use std::{
    str::FromStr,
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

const LEASE: Duration = Duration::from_secs(30);
const TTL: Duration = Duration::from_secs(24 * 3600);

/// A payment API's answer, about 300 bytes (as in `benches/growth.rs`).
const RESPONSE_BODY: &[u8] = br#"{"id":"pay_3MtwBwLkdIwHu7ix28a3tqPa","object":"payment","amount":1250,"amount_received":1250,"currency":"eur","customer":"cus_NffrFeUfNV2Hib","description":"order 42","status":"succeeded","created":1700000000,"livemode":false,"metadata":{"order_id":"6735"},"payment_method":"pm_1MtwBwLkdIwHu7ixnQQ8OVUL"}"#;

/// The rows as the benchmarks' requests make them: a tenant's scope (`auth:` and a
/// SHA-256), a UUID-long key, a SHA-256 fingerprint.
const SCOPE_SQL: &str =
    "'auth:' || encode(sha256(convert_to('tenant-' || (i % 1000), 'UTF8')), 'hex')";
const KEY_SQL: &str = "substr(encode(sha256(convert_to('old-' || i, 'UTF8')), 'hex'), 1, 36)";
const FINGERPRINT_SQL: &str = "sha256(convert_to('fp-' || i, 'UTF8'))";

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

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn scope(i: u64) -> Scope {
    Scope::new(format!(
        "auth:{}",
        hex(&Sha256::digest(format!("tenant-{}", i % 1000).as_bytes()))
    ))
}

fn key(prefix: &str, i: u64) -> String {
    hex(&Sha256::digest(format!("{prefix}{i}").as_bytes()))[..36].to_owned()
}

fn percentile(sorted: &[u64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    sorted[i.min(sorted.len() - 1)] as f64
}

/// Claim latencies in µs, by kind.
#[derive(Default)]
struct Series(Vec<u64>);

impl Series {
    fn p(&mut self, q: f64) -> f64 {
        self.0.sort_unstable();
        percentile(&self.0, q)
    }
}

async fn store(url: &str, schema: &str) -> PostgresStore {
    let store = PostgresStore::new(pool_for_url(url, 4).expect("pool"))
        .with_schema_name(schema)
        .expect("schema name")
        .with_background_purge(None)
        .with_liveness(false);
    store.migrate().await.expect("migrate");
    store
}

/// Claims `key` in `scope` with `fingerprint`; its latency in µs, and what it found.
async fn timed_claim(
    store: &PostgresStore,
    scope: &Scope,
    key: &str,
    fingerprint: Fingerprint,
) -> (u64, Claim) {
    let req = ClaimRequest {
        scope,
        key,
        fingerprint,
        lease: LEASE,
        ttl: TTL,
    };
    let t = Instant::now();
    let claim = store.claim(&req).await.expect("claim");
    (t.elapsed().as_micros() as u64, claim)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let rows: u64 = env_or("REMEMBERED_ROWS", 10_000_000);
    let rounds: u64 = env_or("REMEMBERED_ROUNDS", 10);
    let per_round: u64 = env_or("REMEMBERED_CLAIMS", 500);
    let chunk: u64 = env_or("REMEMBERED_LOAD_CHUNK", 1_000_000);
    let keep = env_or("REMEMBERED_KEEP", 0u8) == 1;
    let url = std::env::var("BENCH_DATABASE_URL")
        .ok()
        .filter(|u| !u.is_empty())
        .unwrap_or_else(|| "postgres://postgres@127.0.0.1:5432/tower_idempotency_bench".into());
    let base = support::BenchDatabase::open(&url, "tower_idempotency_remembered_admin").await;
    let (client, conn) = tokio_postgres::connect(&url, NoTls).await.expect("connect");
    tokio::spawn(conn);
    for schema in ["remembered_empty", "remembered_full"] {
        client
            .batch_execute(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"))
            .await
            .expect("drop");
    }
    let empty = store(&url, "remembered_empty").await;
    let full = store(&url, "remembered_full").await;
    let table = "remembered_full.idempotency_keys";
    client
        .batch_execute(&format!(
            "ALTER TABLE {table} SET (autovacuum_enabled = false)"
        ))
        .await
        .expect("autovacuum off");

    // The remembered rows, as the purge leaves them: completed over a day two days
    // ago, their response gone, forgotten over a day five days from now (times spread
    // to the second, as real ones are: the `expires_at` index deduplicates equal
    // values).
    let loading = Instant::now();
    let mut from = 1;
    while from <= rows {
        let to = (from + chunk - 1).min(rows);
        client
            .batch_execute(&format!(
                "INSERT INTO {table} (scope, key, fingerprint, state, token, expires_at, created_at,
                                      completed_at, status, headers, body)
                 SELECT {SCOPE_SQL}, {KEY_SQL}, {FINGERPRINT_SQL}, 'completed', i,
                        now() + interval '5 days' + (i % 86400) * interval '1 second',
                        now() - interval '2 days' + (i % 86400) * interval '1 second',
                        now() - interval '2 days' + (i % 86400) * interval '1 second',
                        201, NULL, NULL
                 FROM generate_series({from}, {to}) AS i"
            ))
            .await
            .expect("load");
        eprintln!(
            "loaded {to} of {rows} rows ({:.0} s)",
            loading.elapsed().as_secs_f64()
        );
        from = to + 1;
    }
    client
        .batch_execute(&format!("VACUUM ANALYZE {table}"))
        .await
        .expect("vacuum");
    let load_secs = loading.elapsed().as_secs_f64();

    // Bytes: the row as stored, and the heap and primary key per row.
    let sizes = client
        .query_one(
            &format!(
                "SELECT (SELECT avg(pg_column_size(t.*))::float8 FROM {table} AS t TABLESAMPLE SYSTEM (0.1)),
                        pg_relation_size('{table}')::float8 / {rows},
                        pg_relation_size('remembered_full.idempotency_keys_pkey')::float8 / {rows},
                        pg_indexes_size('{table}')::float8 / {rows},
                        pg_total_relation_size('{table}')::float8 / {rows}"
            ),
            &[],
        )
        .await
        .expect("sizes");
    let (row, heap, pkey, indexes, total): (f64, f64, f64, f64, f64) = (
        sizes.get(0),
        sizes.get(1),
        sizes.get(2),
        sizes.get(3),
        sizes.get(4),
    );

    // Completed keys on the empty table, to replay (and to size a completed row).
    let mut headers = HeaderMap::new();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    let response = StoredResponse {
        status: StatusCode::CREATED,
        headers,
        body: Bytes::from_static(RESPONSE_BODY),
    };
    let done = 1000;
    for i in 0..done {
        let key = key("done-", i);
        let fp = Fingerprint::new(Sha256::digest(key.as_bytes()).into());
        let (_, claim) = timed_claim(&empty, &scope(i), &key, fp).await;
        let Claim::Acquired(lease) = claim else {
            panic!("a new key")
        };
        assert!(
            empty
                .complete(&lease, &response, TTL)
                .await
                .expect("complete")
                .is_kept()
        );
    }
    let completed_row: f64 = client
        .query_one(
            "SELECT avg(pg_column_size(t.*))::float8 FROM remembered_empty.idempotency_keys AS t",
            &[],
        )
        .await
        .expect("completed row")
        .get(0);

    // Alternating rounds, one claim at a time.
    let (mut new_empty, mut new_full, mut late, mut replay) = (
        Series::default(),
        Series::default(),
        Series::default(),
        Series::default(),
    );
    let mut n = 0u64;
    for round in 0..rounds {
        for _ in 0..per_round {
            n += 1;
            for (store, series) in [(&empty, &mut new_empty), (&full, &mut new_full)] {
                let key = key(&format!("new-{round}-"), n);
                let fp = Fingerprint::new(Sha256::digest(key.as_bytes()).into());
                let (us, claim) = timed_claim(store, &scope(n), &key, fp).await;
                assert!(matches!(claim, Claim::Acquired(_)));
                series.0.push(us);
            }
            // A late retry of an old key, spread over the whole table.
            let i = 1 + (n * 2_654_435_761) % rows;
            let old = key("old-", i);
            let fp = Fingerprint::new(Sha256::digest(format!("fp-{i}").as_bytes()).into());
            let (us, claim) = timed_claim(&full, &scope(i), &old, fp).await;
            assert!(matches!(claim, Claim::Remembered { .. }), "{claim:?}");
            late.0.push(us);
            let j = n % done;
            let key = key("done-", j);
            let fp = Fingerprint::new(Sha256::digest(key.as_bytes()).into());
            let (us, claim) = timed_claim(&empty, &scope(j), &key, fp).await;
            assert!(matches!(claim, Claim::Completed { .. }));
            replay.0.push(us);
        }
    }

    let mut out = String::new();
    macro_rules! println {
        () => { out.push('\n') };
        ($($arg:tt)*) => {{ out.push_str(&format!($($arg)*)); out.push('\n'); }};
    }
    println!("## Remembered keys ({rows} rows loaded in {load_secs:.0} s)\n");
    println!("| bytes per key | remembered row | completed row (300-byte body) |");
    println!("|---|---:|---:|");
    println!("| the row (`pg_column_size`) | {row:.0} | {completed_row:.0} |");
    println!("| heap per row (`pg_relation_size` / rows) | {heap:.0} | |");
    println!("| primary key per row | {pkey:.0} | |");
    println!("| all indexes per row (`pg_indexes_size` / rows) | {indexes:.0} | |");
    println!(
        "| table, indexes and TOAST per row (`pg_total_relation_size` / rows) | {total:.0} | |"
    );
    println!();
    println!(
        "| claims, one at a time ({} each) | p50 µs | p99 µs |",
        rounds * per_round
    );
    println!("|---|---:|---:|");
    let (e50, e99) = (new_empty.p(0.5), new_empty.p(0.99));
    let (f50, f99) = (new_full.p(0.5), new_full.p(0.99));
    println!("| new key, empty table | {e50:.0} | {e99:.0} |");
    println!("| new key, {rows} remembered rows | {f50:.0} | {f99:.0} |");
    println!(
        "| ratio (full / empty) | {:.2} | {:.2} |",
        f50 / e50,
        f99 / e99
    );
    let (l50, l99) = (late.p(0.5), late.p(0.99));
    let (r50, r99) = (replay.p(0.5), replay.p(0.99));
    println!("| late retry (remembered key), full table | {l50:.0} | {l99:.0} |");
    println!("| replay (completed key), empty table | {r50:.0} | {r99:.0} |");
    println!(
        "| ratio (late retry / replay) | {:.2} | {:.2} |",
        l50 / r50,
        l99 / r99
    );
    print!("{out}");
    let dir = support::in_repository(env_or("BENCH_OUT_DIR", "target/bench".to_owned()));
    std::fs::create_dir_all(&dir).expect("the output directory");
    std::fs::write(dir.join("remembered.md"), out).expect("remembered.md");

    if !keep {
        for schema in ["remembered_empty", "remembered_full"] {
            client
                .batch_execute(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"))
                .await
                .expect("drop");
        }
        base.drop_if_created().await;
    }
}
