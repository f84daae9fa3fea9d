//! What the in-memory store holds: resident memory as distinct keys arrive.
//!
//! Two measurements, both of resident memory (`VmRSS` in `/proc/<pid>/status`), which is
//! what a process's budget is counted in:
//!
//! 1. **The store alone**, in this process: an Axum route like the payments demo's
//!    behind `IdempotencyLayer::new(MemoryStore::new())`, called in-process (no HTTP)
//!    with `MEMORY_STORE_KEYS` distinct keys (300 000: the store fills, then evicts);
//!    resident memory each time another bound's worth of keys has been sent, against
//!    the records held and the bytes the store counts.
//! 2. **The payments demo** on its embedded default (the memory store), as a process of
//!    its own, sent `MEMORY_KEYS` `POST /payments` with distinct keys by
//!    `MEMORY_CLIENTS` keep-alive clients; its resident memory every `MEMORY_EVERY`
//!    keys, read while it is idle between batches.
//!
//! ```sh
//! cargo build --release --example payments && cargo bench -p benches --bench memory
//! ```
//!
//! `cargo bench` does not build examples: the demo is the one at
//! `target/release/examples/payments` (or `MEMORY_DEMO`). `MEMORY_DEMO_ARGS` adds
//! arguments to its command line (split on spaces).
#![allow(missing_docs)]

#[path = "support/wire.rs"]
mod wire;

use std::{
    io::{BufRead, BufReader, Read, Write},
    net::{SocketAddr, TcpStream},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use axum::{Json, Router, http::StatusCode, response::IntoResponse, routing::post};
use serde_json::json;
use tower::ServiceExt;
use tower_idempotency::{IdempotencyKey, IdempotencyLayer, store::MemoryStore};

fn env<T: std::str::FromStr>(name: &str, default: T) -> T {
    match std::env::var(name) {
        Ok(v) if !v.is_empty() => v
            .parse()
            .unwrap_or_else(|_| panic!("{name}={v:?}: not a valid value")),
        _ => default,
    }
}

/// A `/proc/<pid>/status` figure in KiB.
fn status_kib(pid: &str, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|status| {
            status.lines().find_map(|line| {
                let rest = line.strip_prefix(field)?.strip_prefix(':')?;
                rest.trim().trim_end_matches("kB").trim().parse().ok()
            })
        })
        .unwrap_or(0)
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

/// The demo's answer, as its handler builds it (a fixed charge id: the provider is not
/// part of the store's cost).
async fn create_payment(key: IdempotencyKey) -> impl IntoResponse {
    let payment_id = format!("pay_{}", &key.derive("payment")[..24]);
    (
        StatusCode::CREATED,
        Json(json!({
            "payment_id": payment_id,
            "charge_id": "ch_0123456789abcdef",
            "amount": 1250,
            "currency": "EUR",
        })),
    )
}

async fn store_alone(keys: u64) {
    let store = MemoryStore::new();
    let app = Router::new()
        .route("/payments", post(create_payment))
        .layer(IdempotencyLayer::new(store.clone()).require_key(true));
    let send = |key: String| {
        let app = app.clone();
        async move {
            let req = axum::http::Request::post("/payments")
                .header("idempotency-key", key)
                .header("content-type", "application/json")
                .body(axum::body::Body::from(
                    r#"{"amount":1250,"currency":"EUR"}"#,
                ))
                .expect("a request");
            let res = app.oneshot(req).await.expect("infallible");
            assert_eq!(res.status(), StatusCode::CREATED);
        }
    };
    // Warm up the allocator and the runtime on keys of another store.
    for i in 0..1000 {
        let warm = Router::new()
            .route("/payments", post(create_payment))
            .layer(IdempotencyLayer::new(MemoryStore::new()).require_key(true));
        let req = axum::http::Request::post("/payments")
            .header("idempotency-key", format!("warm-{i}"))
            .body(axum::body::Body::from(
                r#"{"amount":1250,"currency":"EUR"}"#,
            ))
            .expect("a request");
        let _ = warm.oneshot(req).await;
    }
    let me = std::process::id().to_string();
    let before = status_kib(&me, "VmRSS");
    let started = Instant::now();
    println!(
        "store alone: resident {:.1} MiB before; a row every {} keys (the store's bound)",
        mib(before),
        store.max_entries()
    );
    println!();
    println!(
        "| distinct keys sent | records held | bytes counted (`bytes()`) | resident memory | resident per record held | resident / counted |"
    );
    println!("|---:|---:|---:|---:|---:|---:|");
    for i in 0..keys {
        send(format!("{:08x}-0000-4000-8000-{i:012x}", i * 7919)).await;
        let sent = i + 1;
        if sent % store.max_entries() as u64 == 0 || sent == keys {
            let grown = (status_kib(&me, "VmRSS").saturating_sub(before) * 1024) as f64;
            println!(
                "| {sent} | {} | {} | +{:.1} MiB | {:.0} bytes | {:.2} |",
                store.len(),
                store.bytes(),
                grown / (1024.0 * 1024.0),
                grown / store.len().max(1) as f64,
                grown / store.bytes().max(1) as f64,
            );
        }
    }
    println!();
    println!(
        "store alone: {keys} keys in {:.1} s, {} evicted",
        started.elapsed().as_secs_f64(),
        store.evicted()
    );
}

/// `target/release/examples/payments`, beside this bench's `target/release/deps/`.
fn demo_binary() -> PathBuf {
    if let Ok(path) = std::env::var("MEMORY_DEMO") {
        // From the repository's root, as the other paths the benchmarks are given:
        // `cargo bench -p benches` runs this in `benches/`.
        return Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .expect("the benchmarks' crate is a directory of the repository")
            .join(path);
    }
    let exe = std::env::current_exe().expect("the path of the bench binary");
    exe.parent()
        .and_then(|deps| deps.parent())
        .expect("the bench binary lives in target/<profile>/deps/")
        .join("examples")
        .join("payments")
}

struct Demo(Child);

impl Drop for Demo {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `GET /stats` on a connection of its own.
fn demo_stats(addr: SocketAddr) -> String {
    let mut conn = TcpStream::connect(addr).expect("connect for /stats");
    write!(
        conn,
        "GET /stats HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n\r\n"
    )
    .expect("send /stats");
    let mut reply = String::new();
    let _ = conn.read_to_string(&mut reply);
    reply
        .split_once("\r\n\r\n")
        .map_or(reply.clone(), |(_, body)| body.to_owned())
}

async fn demo(keys: u64, every: u64, clients: usize) {
    let bin = demo_binary();
    assert!(
        bin.is_file(),
        "no demo at {}: run `cargo build --release --example payments` first",
        bin.display()
    );
    let extra: Vec<String> = std::env::var("MEMORY_DEMO_ARGS")
        .unwrap_or_default()
        .split_whitespace()
        .map(str::to_owned)
        .collect();
    let mut child = Command::new(&bin)
        .args(["--addr", "127.0.0.1:0"])
        .args(&extra)
        .env_remove("DATABASE_URL")
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start the demo");
    let stdout = child.stdout.take().expect("the demo's stdout");
    let demo = Demo(child);
    let pid = demo.0.id().to_string();
    let mut lines = BufReader::new(stdout).lines();
    let mut addr = None;
    for line in lines.by_ref() {
        let line = line.expect("the demo's stdout");
        println!("demo: {line}");
        if let Some(a) = line.strip_prefix("payments demo listening on http://") {
            addr = Some(a.parse::<SocketAddr>().expect("the demo's address"));
        }
        if line.starts_with("wait:") {
            break;
        }
    }
    let addr = addr.expect("the demo said where it listens");
    // Keep draining its stdout, so that it never blocks on a full pipe.
    std::thread::spawn(move || for _ in lines {});

    let wire = Arc::new(wire::Clients::new(addr, clients));
    let run = format!("{:x}", std::process::id());
    let sent = Arc::new(AtomicU64::new(0));
    let body: &'static [u8] = br#"{"amount":1250,"currency":"EUR"}"#;
    println!();
    println!("| distinct keys sent | resident memory | growth per key since the last row |");
    println!("|---:|---:|---:|");
    let start_kib = status_kib(&pid, "VmRSS");
    println!("| 0 | {:.1} MiB | |", mib(start_kib));
    let (mut last_keys, mut last_kib) = (0u64, start_kib);
    let mut statuses = std::collections::BTreeMap::<u16, u64>::new();
    let started = Instant::now();
    while last_keys < keys {
        let until = (last_keys + every).min(keys);
        let workers: Vec<_> = (0..clients)
            .map(|w| {
                let (wire, run, sent) = (wire.clone(), run.clone(), sent.clone());
                tokio::spawn(async move {
                    let mut seen = std::collections::BTreeMap::<u16, u64>::new();
                    let mut key = String::with_capacity(40);
                    loop {
                        let i = sent.fetch_add(1, Ordering::Relaxed);
                        if i >= until {
                            sent.fetch_sub(1, Ordering::Relaxed);
                            break;
                        }
                        key.clear();
                        use std::fmt::Write as _;
                        let _ = write!(key, "mem-{run}-{i}");
                        let reply = match wire.post(w, Some(&key), body).await {
                            Ok(reply) => reply,
                            Err(e) => panic!("POST /payments: {e}"),
                        };
                        assert!(!reply.replayed, "a new key was answered with a replay");
                        if reply.status >= 500 {
                            eprintln!("{}: {}", reply.status, String::from_utf8_lossy(&reply.body));
                        }
                        *seen.entry(reply.status).or_default() += 1;
                    }
                    seen
                })
            })
            .collect();
        for w in workers {
            for (status, n) in w.await.expect("a client") {
                *statuses.entry(status).or_default() += n;
            }
        }
        // Settled: nothing in flight while it is read.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let kib = status_kib(&pid, "VmRSS");
        println!(
            "| {until} | {:.1} MiB | {:+.0} bytes |",
            mib(kib),
            (kib as f64 - last_kib as f64) * 1024.0 / (until - last_keys) as f64
        );
        (last_keys, last_kib) = (until, kib);
    }
    println!();
    println!(
        "demo: {keys} keys in {:.0} s; answers {statuses:?}; peak resident {:.1} MiB; /stats {}",
        started.elapsed().as_secs_f64(),
        mib(status_kib(&pid, "VmHWM")),
        demo_stats(addr).trim()
    );
}

fn main() {
    // `cargo bench` passes `--bench`; nothing else is taken from the command line.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a runtime");
    let store_keys: u64 = env("MEMORY_STORE_KEYS", 300_000);
    let keys: u64 = env("MEMORY_KEYS", 1_000_000);
    let every: u64 = env("MEMORY_EVERY", 100_000).max(1);
    let clients: usize = env("MEMORY_CLIENTS", 4).max(1);
    runtime.block_on(async {
        if store_keys > 0 {
            store_alone(store_keys).await;
        }
        if keys > 0 {
            demo(keys, every, clients).await;
        }
    });
}
