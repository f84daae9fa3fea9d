//! Where the demo keeps its payments, its fake provider's charges and its counters.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::Duration,
};

use tower_idempotency::{
    store::{PostgresStore, StoreMetrics, pool_for_url},
    transactional::TransactionHandle,
};

pub(crate) type Error = Box<dyn std::error::Error + Send + Sync>;

/// How often the demo's store deletes keys past their TTL (the store's default).
pub(crate) const PURGE_EVERY: Duration = Duration::from_secs(60);

pub(crate) struct Stats {
    pub(crate) handler_runs: i64,
    pub(crate) psp_calls: i64,
    pub(crate) charges: i64,
    pub(crate) payments: i64,
}

#[derive(Clone)]
pub(crate) enum Backend {
    Memory(Arc<Mutex<Memory>>),
    Postgres {
        pool: deadpool_postgres::Pool,
        schema: String,
        store: Box<PostgresStore>,
    },
}

#[derive(Default)]
pub(crate) struct Memory {
    handler_runs: i64,
    psp_calls: i64,
    /// Provider key → (charge id, amount, currency).
    charges: HashMap<String, (String, i64, String)>,
    payments: HashMap<String, String>,
}

/// What the provider did with a charge.
pub(crate) enum Charged {
    /// Charged now, or before under the same key with the same amount and currency.
    Charge(String),
    /// The key was charged before for another payment: nothing charged now.
    OtherPayment { amount: i64, currency: String },
}

impl Backend {
    pub(crate) fn memory() -> Self {
        Self::Memory(Arc::default())
    }

    /// Connects, migrates the idempotency table and the demo's own tables.
    pub(crate) async fn postgres(url: &str, schema: &str) -> Result<(Self, PostgresStore), Error> {
        let pool = pool_for_url(url, 32)?;
        let store = PostgresStore::new(pool.clone())
            .with_schema_name(schema)?
            .with_notifications(url.parse()?)
            // The default, said out loud: keys past their TTL are deleted in the
            // background, by one demo process at a time.
            .with_background_purge(Some(PURGE_EVERY));
        store.migrate().await?;
        let mut client = pool.get().await?;
        let tx = client.transaction().await?;
        // Several demo processes may start at once; one sets up, the others wait.
        tx.execute("SELECT pg_advisory_xact_lock(7242)", &[])
            .await?;
        tx.batch_execute(&format!(
            "CREATE TABLE IF NOT EXISTS \"{schema}\".demo_counters (
                 name text PRIMARY KEY, value bigint NOT NULL);
             INSERT INTO \"{schema}\".demo_counters VALUES ('handler_runs', 0), ('psp_calls', 0)
                 ON CONFLICT DO NOTHING;
             CREATE TABLE IF NOT EXISTS \"{schema}\".demo_psp_charges (
                 psp_key text PRIMARY KEY, charge_id text NOT NULL UNIQUE,
                 amount bigint NOT NULL, currency text NOT NULL,
                 created_at timestamptz NOT NULL DEFAULT now());
             CREATE TABLE IF NOT EXISTS \"{schema}\".demo_payments (
                 payment_id text PRIMARY KEY, charge_id text NOT NULL,
                 amount bigint NOT NULL, currency text NOT NULL,
                 created_at timestamptz NOT NULL DEFAULT now());"
        ))
        .await?;
        tx.commit().await?;
        drop(client);
        Ok((
            Self::Postgres {
                pool,
                schema: schema.to_owned(),
                store: Box::new(store.clone()),
            },
            store,
        ))
    }

    fn lock(m: &Mutex<Memory>) -> std::sync::MutexGuard<'_, Memory> {
        m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    async fn bump(&self, counter: &str) -> Result<(), Error> {
        match self {
            Self::Memory(m) => {
                let mut m = Self::lock(m);
                match counter {
                    "handler_runs" => m.handler_runs += 1,
                    _ => m.psp_calls += 1,
                }
            }
            Self::Postgres { pool, schema, .. } => {
                let client = pool.get().await?;
                let stmt = client
                    .prepare_cached(&format!(
                        "UPDATE \"{schema}\".demo_counters SET value = value + 1 WHERE name = $1"
                    ))
                    .await?;
                client.execute(&stmt, &[&counter]).await?;
            }
        }
        Ok(())
    }

    /// Counts one handler run, in its own statement.
    pub(crate) async fn count_handler_run(&self) -> Result<(), Error> {
        self.bump("handler_runs").await
    }

    /// The fake payment provider: one charge per provider key, whatever the retries.
    /// Like a real one, it refuses a key it has charged under with another amount or
    /// currency, and charges nothing.
    pub(crate) async fn charge(
        &self,
        psp_key: &str,
        amount: i64,
        currency: &str,
    ) -> Result<Charged, Error> {
        self.bump("psp_calls").await?;
        let fresh_id = format!("ch_{:016x}", rand_u64());
        let settled = |(id, charged, charged_in): (String, i64, String)| {
            if charged == amount && charged_in == currency {
                Charged::Charge(id)
            } else {
                Charged::OtherPayment {
                    amount: charged,
                    currency: charged_in,
                }
            }
        };
        match self {
            Self::Memory(m) => {
                let mut m = Self::lock(m);
                let charge = m
                    .charges
                    .entry(psp_key.to_owned())
                    .or_insert_with(|| (fresh_id, amount, currency.to_owned()))
                    .clone();
                Ok(settled(charge))
            }
            Self::Postgres { pool, schema, .. } => {
                let client = pool.get().await?;
                let stmt = client
                    .prepare_cached(&format!(
                        "WITH ins AS (
                             INSERT INTO \"{schema}\".demo_psp_charges (psp_key, charge_id, amount, currency)
                             VALUES ($1, $2, $3, $4) ON CONFLICT (psp_key) DO NOTHING
                             RETURNING charge_id, amount, currency)
                         SELECT charge_id, amount, currency FROM ins
                         UNION ALL
                         SELECT charge_id, amount, currency FROM \"{schema}\".demo_psp_charges
                         WHERE psp_key = $1 AND NOT EXISTS (SELECT 1 FROM ins)"
                    ))
                    .await?;
                for _ in 0..8 {
                    let rows = client
                        .query(&stmt, &[&psp_key, &fresh_id, &amount, &currency])
                        .await?;
                    if let Some(row) = rows.first() {
                        return Ok(settled((row.get(0), row.get(1), row.get(2))));
                    }
                }
                Err("the provider could not settle the charge".into())
            }
        }
    }

    /// Records the payment once per payment id.
    pub(crate) async fn record_payment(
        &self,
        payment_id: &str,
        charge_id: &str,
        amount: i64,
        currency: &str,
    ) -> Result<(), Error> {
        match self {
            Self::Memory(m) => {
                Self::lock(m)
                    .payments
                    .entry(payment_id.to_owned())
                    .or_insert_with(|| charge_id.to_owned());
            }
            Self::Postgres { pool, schema, .. } => {
                let client = pool.get().await?;
                let stmt = client
                    .prepare_cached(&format!(
                        "INSERT INTO \"{schema}\".demo_payments (payment_id, charge_id, amount, currency)
                         VALUES ($1, $2, $3, $4) ON CONFLICT (payment_id) DO NOTHING"
                    ))
                    .await?;
                client
                    .execute(&stmt, &[&payment_id, &charge_id, &amount, &currency])
                    .await?;
            }
        }
        Ok(())
    }

    /// Records the payment inside the request's idempotency transaction.
    pub(crate) async fn record_payment_in(
        &self,
        tx: &TransactionHandle,
        payment_id: &str,
        charge_id: &str,
        amount: i64,
        currency: &str,
    ) -> Result<(), Error> {
        let Self::Postgres { schema, .. } = self else {
            return Err("transactional mode needs PostgreSQL".into());
        };
        let client = tx.client().await?;
        let stmt = client
            .prepare_cached(&format!(
                "INSERT INTO \"{schema}\".demo_payments (payment_id, charge_id, amount, currency)
                 VALUES ($1, $2, $3, $4) ON CONFLICT (payment_id) DO NOTHING"
            ))
            .await?;
        client
            .execute(&stmt, &[&payment_id, &charge_id, &amount, &currency])
            .await?;
        Ok(())
    }

    pub(crate) fn store_metrics(&self) -> Option<StoreMetrics> {
        match self {
            Self::Memory(_) => None,
            Self::Postgres { store, .. } => Some(store.metrics()),
        }
    }

    pub(crate) fn is_listening(&self) -> bool {
        matches!(self, Self::Postgres { store, .. } if store.is_listening())
    }

    pub(crate) async fn stats(&self) -> Result<Stats, Error> {
        match self {
            Self::Memory(m) => {
                let m = Self::lock(m);
                Ok(Stats {
                    handler_runs: m.handler_runs,
                    psp_calls: m.psp_calls,
                    charges: m.charges.len() as i64,
                    payments: m.payments.len() as i64,
                })
            }
            Self::Postgres { pool, schema, .. } => {
                let client = pool.get().await?;
                let row = client
                    .query_one(
                        &format!(
                            "SELECT
                               (SELECT value FROM \"{schema}\".demo_counters WHERE name = 'handler_runs'),
                               (SELECT value FROM \"{schema}\".demo_counters WHERE name = 'psp_calls'),
                               (SELECT count(*) FROM \"{schema}\".demo_psp_charges),
                               (SELECT count(*) FROM \"{schema}\".demo_payments)"
                        ),
                        &[],
                    )
                    .await?;
                Ok(Stats {
                    handler_runs: row.get(0),
                    psp_calls: row.get(1),
                    charges: row.get(2),
                    payments: row.get(3),
                })
            }
        }
    }
}

/// A random number for the provider's charge ids, from the std hasher's random keys.
fn rand_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.finish()
}
