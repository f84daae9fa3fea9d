//! A queue consumer that applies each message once, however often it is delivered.
//!
//! ```text
//! cargo run --example queue_consumer                      # lease mode, in memory
//! DATABASE_URL=postgres://postgres@127.0.0.1/postgres \
//!     cargo run --example queue_consumer                  # transactional, in PostgreSQL
//! ```
//!
//! The "queue" delivers every message at least once: some twice, some three times,
//! some of those at the same moment, as a broker does after a consumer's ack times out.
//! Each delivery goes through a `JobRunner` keyed by the message id. With PostgreSQL
//! the credit is written inside the job's transaction, so the balance row and the
//! stored result commit together.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
};

use bytes::Bytes;
use tower_idempotency::{
    Scope,
    job::{JobContext, JobError, JobOutcome, JobRunner},
    store::{MemoryStore, PostgresStore},
};

type Error = Box<dyn std::error::Error + Send + Sync>;

#[derive(Clone)]
enum Ledger {
    Memory(Arc<Mutex<HashMap<String, i64>>>),
    Postgres { table: String },
}

impl Ledger {
    async fn credit(&self, ctx: JobContext, account: String, amount: i64) -> Result<Bytes, String> {
        match self {
            Ledger::Memory(balances) => {
                let mut balances = balances.lock().map_err(|e| e.to_string())?;
                *balances.entry(account.clone()).or_default() += amount;
            }
            Ledger::Postgres { table } => {
                let tx = ctx.transaction.ok_or("transactional mode expected")?;
                let client = tx.client().await.map_err(|e| e.to_string())?;
                client
                    .execute(
                        &format!(
                            "INSERT INTO {table} (account, balance) VALUES ($1, $2)
                             ON CONFLICT (account) DO UPDATE SET balance = {table}.balance + $2"
                        ),
                        &[&account, &amount],
                    )
                    .await
                    .map_err(|e| e.to_string())?;
            }
        }
        Ok(Bytes::from(format!("credited {amount} to {account}")))
    }
}

#[tokio::main]
async fn main() -> Result<(), Error> {
    let (runner, ledger) = match std::env::var("DATABASE_URL").ok().filter(|u| !u.is_empty()) {
        Some(url) => {
            let store = PostgresStore::connect(&url)?.with_schema_name("queue_demo")?;
            store.migrate().await?;
            let table = "\"queue_demo\".balances".to_owned();
            store
                .pool()
                .get()
                .await?
                .batch_execute(&format!(
                    "CREATE TABLE IF NOT EXISTS {table} (account text PRIMARY KEY, balance bigint NOT NULL)"
                ))
                .await?;
            println!("store: postgres, transactional mode (schema queue_demo)");
            (JobRunner::transactional(store), Ledger::Postgres { table })
        }
        None => {
            println!("store: memory, lease mode (set DATABASE_URL for PostgreSQL)");
            (
                JobRunner::new(MemoryStore::new()),
                Ledger::Memory(Arc::default()),
            )
        }
    };

    // Ten messages; message i is delivered 1 + i % 3 times, all at once.
    let run_id = std::process::id();
    let scope = Scope::new("billing-consumer");
    let mut deliveries = Vec::new();
    for i in 0..10 {
        for _ in 0..=(i % 3) {
            let (runner, ledger, scope) = (runner.clone(), ledger.clone(), scope.clone());
            deliveries.push(tokio::spawn(async move {
                let id = format!("msg-{run_id}-{i}");
                let payload = format!("credit acct-{} 100", i % 2);
                runner
                    .run(&scope, &id, payload.as_bytes(), move |ctx| async move {
                        ledger.credit(ctx, format!("acct-{}", i % 2), 100).await
                    })
                    .await
                    .map(|outcome| (id, outcome))
            }));
        }
    }
    let (mut applied, mut skipped, mut busy) = (0, 0, 0);
    for delivery in deliveries {
        match delivery.await? {
            Ok((id, JobOutcome::Ran(result))) => {
                applied += 1;
                println!("{id}: {}", String::from_utf8_lossy(&result));
            }
            Ok((id, JobOutcome::AlreadyDone(_))) => {
                skipped += 1;
                println!("{id}: duplicate delivery, already applied");
            }
            // A late redelivery (a dead-letter replay): applied long ago, its result no
            // longer kept, its key still remembered. Ack it; it is not applied again.
            Ok((id, JobOutcome::ResultExpired { completed_at, .. })) => {
                skipped += 1;
                println!("{id}: late redelivery, applied at {completed_at:?}; not applied again");
            }
            Ok((id, JobOutcome::Running { retry_after })) => {
                // Not done yet: do not ack. The worker applying it may still fail and
                // release it; a broker redelivers this copy after `retry_after`.
                busy += 1;
                println!(
                    "{id}: duplicate delivery while another worker applies it; nack, redeliver in {retry_after:?}"
                );
            }
            // The producer sent another payload under this id: no redelivery can apply
            // it. A real consumer dead-letters it.
            Err(JobError::Mismatch) => {
                println!("delivery with another payload under a used id: dead-letter it")
            }
            // It ran, but its key was taken over meanwhile: ack it, and raise an alarm.
            Err(JobError::TakenOver(_)) => {
                println!("applied, but another worker took the key over: it may have run twice")
            }
            Err(e) => println!("delivery failed, nack it to be redelivered: {e}"),
        }
    }
    println!(
        "applied {applied}, skipped {skipped} duplicates, {busy} nacked while in progress elsewhere"
    );
    // Before exiting: wait for any result still being stored in the background, so that
    // no key is left claimed until its lease lapses.
    runner.shutdown_handle().drain().await;
    Ok(())
}
