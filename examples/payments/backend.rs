//! Where the demo keeps its payments, its fake provider's charges and its counters.

use std::{
    collections::{HashMap, VecDeque},
    sync::{Arc, Mutex},
    time::Duration,
};

use deadpool_postgres::ClientWrapper;
use tokio_postgres::{
    Row,
    types::{ToSql, Type},
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
        /// Behind a transaction-pooling PgBouncer: statements unnamed (see `query`).
        pooled: bool,
    },
}

/// The demo's own records on the memory store, bounded as the store is: it remembers
/// the last charges and payments, and counts them all.
pub(crate) struct Memory {
    handler_runs: i64,
    psp_calls: i64,
    /// Charges made and payments recorded, each counted once, however many of them the
    /// ledgers below still remember.
    charges_made: i64,
    payments_recorded: i64,
    /// Provider key → charge: the fake provider remembers its last charges only, so a
    /// key it has forgotten is charged anew, as a key the store evicted runs anew.
    charges: Ledger<Charge>,
    /// Payment id → charge id.
    payments: Ledger<Box<str>>,
}

#[derive(Clone, Copy)]
struct Charge {
    /// The random number in the charge id, `ch_` and its 16 hex digits.
    id: u64,
    amount: i64,
    currency: [u8; 3],
}

/// A map that keeps its last `cap` entries: past it, a new one pushes out the oldest.
struct Ledger<V> {
    entries: HashMap<Arc<str>, V>,
    /// The keys, oldest first (each shares its name with its entry).
    order: VecDeque<Arc<str>>,
    cap: usize,
}

impl<V: Clone> Ledger<V> {
    fn new(cap: usize) -> Self {
        Self {
            entries: HashMap::new(),
            order: VecDeque::new(),
            cap: cap.max(1),
        }
    }

    /// The value of `key`, or `make()`'s, stored for it now; `true` if it is new.
    fn get_or_insert_with(&mut self, key: &str, make: impl FnOnce() -> V) -> (V, bool) {
        if let Some(value) = self.entries.get(key) {
            return (value.clone(), false);
        }
        if self.entries.len() >= self.cap
            && let Some(oldest) = self.order.pop_front()
        {
            self.entries.remove(&oldest);
        }
        let (key, value) = (Arc::<str>::from(key), make());
        self.order.push_back(key.clone());
        self.entries.insert(key, value.clone());
        (value, true)
    }
}

/// `e` as the demo prints it: the database's message and SQLSTATE (and its detail and
/// hint) for an error of the demo's own statements, which the driver's `Display` leaves
/// out ("db error"); the idempotency store's errors say so themselves.
pub(crate) fn describe(e: &(dyn std::error::Error + 'static)) -> String {
    let Some(db) = e
        .downcast_ref::<tokio_postgres::Error>()
        .and_then(tokio_postgres::Error::as_db_error)
    else {
        return e.to_string();
    };
    let mut shown = format!("{} (SQLSTATE {})", db.message(), db.code().code());
    if let Some(detail) = db.detail() {
        shown.push_str(&format!("; detail: {detail}"));
    }
    if let Some(hint) = db.hint() {
        shown.push_str(&format!("; hint: {hint}"));
    }
    shown
}

/// The idempotency store's migrations as SQL, for `schema`. Nothing connects: without
/// a database URL, any will do.
pub(crate) fn migration_sql(url: Option<&str>, schema: &str) -> Result<String, Error> {
    let url = url.unwrap_or("postgres://localhost/postgres");
    let store = PostgresStore::connect(url)?.with_schema_name(schema)?;
    Ok(store.migration_sql())
}

/// Runs `sql` on `client`: prepared once per connection, or, behind a transaction
/// pooler (`pooled`), unnamed, as the store's statements are there
/// (`PostgresStore::with_transaction_pooling`).
async fn query(
    client: &ClientWrapper,
    pooled: bool,
    sql: &str,
    params: &[(&(dyn ToSql + Sync), Type)],
) -> Result<Vec<Row>, Error> {
    if pooled {
        return Ok(client.query_typed(sql, params).await?);
    }
    let stmt = client.prepare_cached(sql).await?;
    let values: Vec<&(dyn ToSql + Sync)> = params.iter().map(|(value, _)| *value).collect();
    Ok(client.query(&stmt, &values).await?)
}

/// Records a payment once per payment id.
fn insert_payment(schema: &str) -> String {
    format!(
        "INSERT INTO \"{schema}\".demo_payments (payment_id, charge_id, amount, currency)
         VALUES ($1, $2, $3, $4) ON CONFLICT (payment_id) DO NOTHING"
    )
}

/// The parameters of [`insert_payment`].
fn payment_params<'a>(
    payment_id: &'a &str,
    charge_id: &'a &str,
    amount: &'a i64,
    currency: &'a &str,
) -> [(&'a (dyn ToSql + Sync), Type); 4] {
    [
        (payment_id, Type::TEXT),
        (charge_id, Type::TEXT),
        (amount, Type::INT8),
        (currency, Type::TEXT),
    ]
}

/// A charge id: `ch_` and 16 hex digits.
fn charge_id(n: u64) -> String {
    format!("ch_{n:016x}")
}

/// What the provider did with a charge: recorded as the payment's `charge` step, so
/// that a retry after a crash gets it without calling the provider again.
#[derive(serde::Serialize, serde::Deserialize)]
pub(crate) enum Charged {
    /// Charged now, or before under the same key with the same amount and currency.
    Charge(String),
    /// The key was charged before for another payment: nothing charged now.
    OtherPayment { amount: i64, currency: String },
}

impl Backend {
    /// The demo's records in memory, remembering the last `remembered` charges and
    /// payments.
    pub(crate) fn memory(remembered: usize) -> Self {
        Self::Memory(Arc::new(Mutex::new(Memory {
            handler_runs: 0,
            psp_calls: 0,
            charges_made: 0,
            payments_recorded: 0,
            charges: Ledger::new(remembered),
            payments: Ledger::new(remembered),
        })))
    }

    /// Connects, migrates the idempotency table and the demo's own tables. `pooled`:
    /// `url` is a transaction-pooling PgBouncer, and `listen_url` (if any) the database
    /// itself, for `LISTEN`. Completed keys are remembered for `remember` once their
    /// response expired.
    pub(crate) async fn postgres(
        url: &str,
        schema: &str,
        pooled: bool,
        listen_url: Option<&str>,
        remember: Duration,
    ) -> Result<(Self, PostgresStore), Error> {
        let pool = pool_for_url(url, 32)?;
        let store = PostgresStore::new(pool.clone())
            .with_schema_name(schema)?
            .with_transaction_pooling(pooled);
        // Behind a transaction pooler `LISTEN` needs the database itself; without its
        // URL, waiting duplicates look again on a timer.
        let store = match (pooled, listen_url) {
            (_, Some(direct)) => store.with_notifications(direct.parse()?),
            (false, None) => store.with_notifications(url.parse()?),
            (true, None) => store,
        };
        let store = store
            // The default, said out loud: keys past their TTL are deleted in the
            // background, by one demo process at a time.
            .with_background_purge(Some(PURGE_EVERY))
            .remember_keys_for(remember);
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
                pooled,
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
            Self::Postgres {
                pool,
                schema,
                pooled,
                ..
            } => {
                let client = pool.get().await?;
                let sql = format!(
                    "UPDATE \"{schema}\".demo_counters SET value = value + 1 WHERE name = $1"
                );
                query(&client, *pooled, &sql, &[(&counter, Type::TEXT)]).await?;
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
        let fresh = rand_u64();
        let fresh_id = charge_id(fresh);
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
                let code: [u8; 3] = currency
                    .as_bytes()
                    .try_into()
                    .map_err(|_| "a currency is 3 letters")?;
                let mut m = Self::lock(m);
                let (charge, new) = m.charges.get_or_insert_with(psp_key, || Charge {
                    id: fresh,
                    amount,
                    currency: code,
                });
                m.charges_made += i64::from(new);
                let charged_in = String::from_utf8_lossy(&charge.currency).into_owned();
                Ok(settled((charge_id(charge.id), charge.amount, charged_in)))
            }
            Self::Postgres {
                pool,
                schema,
                pooled,
                ..
            } => {
                let client = pool.get().await?;
                let sql = format!(
                        "WITH ins AS (
                             INSERT INTO \"{schema}\".demo_psp_charges (psp_key, charge_id, amount, currency)
                             VALUES ($1, $2, $3, $4) ON CONFLICT (psp_key) DO NOTHING
                             RETURNING charge_id, amount, currency)
                         SELECT charge_id, amount, currency FROM ins
                         UNION ALL
                         SELECT charge_id, amount, currency FROM \"{schema}\".demo_psp_charges
                         WHERE psp_key = $1 AND NOT EXISTS (SELECT 1 FROM ins)"
                    );
                let params: [(&(dyn ToSql + Sync), Type); 4] = [
                    (&psp_key, Type::TEXT),
                    (&fresh_id, Type::TEXT),
                    (&amount, Type::INT8),
                    (&currency, Type::TEXT),
                ];
                for _ in 0..8 {
                    let rows = query(&client, *pooled, &sql, &params).await?;
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
                let mut m = Self::lock(m);
                let (_, new) = m
                    .payments
                    .get_or_insert_with(payment_id, || charge_id.into());
                m.payments_recorded += i64::from(new);
            }
            Self::Postgres {
                pool,
                schema,
                pooled,
                ..
            } => {
                let client = pool.get().await?;
                let sql = insert_payment(schema);
                let params = payment_params(&payment_id, &charge_id, &amount, &currency);
                query(&client, *pooled, &sql, &params).await?;
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
        let Self::Postgres { schema, pooled, .. } = self else {
            return Err("transactional mode needs PostgreSQL".into());
        };
        let client = tx.client().await?;
        let params = payment_params(&payment_id, &charge_id, &amount, &currency);
        query(&client, *pooled, &insert_payment(schema), &params).await?;
        Ok(())
    }

    /// Records the payment inside the request's idempotency transaction, on sqlx
    /// (`--driver sqlx --mode transactional`): the same statement, sent through the
    /// transaction's `PgConnection`.
    #[cfg(feature = "sqlx")]
    pub(crate) async fn record_payment_in_sqlx(
        &self,
        tx: &tower_idempotency::transactional::SqlxTransaction,
        payment_id: &str,
        charge_id: &str,
        amount: i64,
        currency: &str,
    ) -> Result<(), Error> {
        use sqlx::Executor as _;
        let Self::Postgres { schema, pooled, .. } = self else {
            return Err("transactional mode needs PostgreSQL".into());
        };
        let sql = insert_payment(schema);
        let insert = sqlx::query(&sql)
            // Behind a transaction pooler, unnamed (as `query` sends them).
            .persistent(!*pooled)
            .bind(payment_id)
            .bind(charge_id)
            .bind(amount)
            .bind(currency);
        let mut conn = tx.connection().await?;
        conn.execute(insert).await?;
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
                    charges: m.charges_made,
                    payments: m.payments_recorded,
                })
            }
            Self::Postgres {
                pool,
                schema,
                pooled,
                ..
            } => {
                let client = pool.get().await?;
                let sql = format!(
                    "SELECT
                       (SELECT value FROM \"{schema}\".demo_counters WHERE name = 'handler_runs'),
                       (SELECT value FROM \"{schema}\".demo_counters WHERE name = 'psp_calls'),
                       (SELECT count(*) FROM \"{schema}\".demo_psp_charges),
                       (SELECT count(*) FROM \"{schema}\".demo_payments)"
                );
                let rows = query(&client, *pooled, &sql, &[]).await?;
                let row = rows.first().ok_or("no statistics")?;
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
