//! The background purge: expired rows deleted without the app having to ask.
//!
//! A store used by a layer (or a `JobRunner`) starts one purger at its first claim,
//! shared by its clones. Every `every` (± 20 %, so that replicas started together spread
//! out) it deletes expired rows in batches until a batch comes back short. Each batch is
//! one statement that first tries a transaction-scoped advisory lock of the table's
//! own: while one replica purges, the others' batches delete nothing and wait for their
//! next turn, so replicas never purge side by side. The purger ends with the last clone
//! of its store.
//!
//! Over a table in generations (`PostgresStore::with_generations`) a round rotates
//! them instead (`generations::Rotator`), in the same turns.

use std::{
    sync::{
        Arc, Weak,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use deadpool_postgres::Pool;
use tracing::Instrument;

use tokio_postgres::types::ToSql;

use super::{
    Checkout,
    errors::describe,
    generations::{GenerationRotation, Rotator},
    sql::{self, Statement},
    tls::Connector,
};

/// How often a store purges by default.
pub(super) const DEFAULT_EVERY: Duration = Duration::from_secs(60);

/// Rows deleted per statement.
const BATCH: i64 = 1000;

/// The shortest period accepted.
const SHORTEST: Duration = Duration::from_millis(10);

/// How long one batch may take before it is given up on (its connection closed, which
/// cancels it): a purge must never hold a connection, or its rows' locks, for long.
const BATCH_BOUND: Duration = Duration::from_secs(30);

/// One store's background purge: its settings, and whether it has started. Held in an
/// `Arc` by every clone of the store; the purger holds it weakly, and stops once it is
/// gone.
pub(super) struct BackgroundPurge {
    every: Option<Duration>,
    started: AtomicBool,
    pool: Pool,
    /// The TLS of the cancel request for a batch given up on (`None`: none is sent).
    connector: Option<Connector>,
    /// The batch statement, with the advisory lock (`Sql::purge_in_turn`).
    statement: Statement,
    /// Whether statements are prepared (see `PostgresStore::with_prepared_statements`).
    prepared: bool,
    /// The table's advisory lock id.
    lock: i64,
    /// Rounds rotate the generations instead of deleting rows, if the table has them.
    rotator: Option<Rotator>,
    /// Forgets the steps transactional mode recorded for keys never completed (rolled
    /// back, and never retried), a day after they were recorded (`steps`).
    forget_stale_steps: String,
}

impl BackgroundPurge {
    /// A purge every `every` (`None`: never) with `statement`, which takes the batch
    /// size and the lock id, and `forget_stale_steps`.
    pub(super) fn new(
        every: Option<Duration>,
        pool: Pool,
        connector: Option<Connector>,
        (statement, forget_stale_steps): (Statement, String),
        prepared: bool,
        lock: i64,
        rotator: Option<Rotator>,
    ) -> Self {
        Self {
            rotator,
            forget_stale_steps,
            every: every.map(|e| e.clamp(SHORTEST, crate::settings::TEN_YEARS)),
            started: AtomicBool::new(false),
            pool,
            connector,
            statement,
            prepared,
            lock,
        }
    }

    /// The period, if purging is on.
    pub(super) fn every(&self) -> Option<Duration> {
        self.every
    }

    /// Starts the purger, once, on the current runtime (a no-op outside one, or with
    /// purging off).
    pub(super) fn start(self: &Arc<Self>) {
        let Some(every) = self.every else {
            return;
        };
        if self.started.load(Ordering::Relaxed) || self.started.swap(true, Ordering::AcqRel) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            self.started.store(false, Ordering::Release);
            return;
        };
        let purge = Arc::downgrade(self);
        runtime.spawn(run(purge, every).instrument(tracing::info_span!("idempotency_purge")));
    }

    /// Deletes expired rows batch after batch while this replica holds the turn;
    /// returns how many. Between batches it rests as long as the last one took, so
    /// that a table with a backlog (millions of rows past their TTL on the first
    /// deployment) is worked through at half a connection's pace, not as one long burst
    /// of deletes; each batch gets a connection of its own from the pool, and is given
    /// up on past `BATCH_BOUND`.
    async fn round(&self) -> Result<u64, String> {
        self.forget_stale_steps().await;
        if self.rotator.is_some() {
            return self
                .rotate()
                .await
                .map(|rotation| rotation.emptied.len() as u64);
        }
        self.batches(&self.statement).await
    }

    /// Batches of `statement` until one comes back short; returns the rows they
    /// changed.
    async fn batches(&self, statement: &Statement) -> Result<u64, String> {
        let mut purged = 0;
        loop {
            let started = tokio::time::Instant::now();
            let deleted = match tokio::time::timeout(BATCH_BOUND, self.batch(statement)).await {
                Ok(Ok(deleted)) => deleted,
                Ok(Err(e)) => {
                    crate::observe::store_failed("purge");
                    return Err(e);
                }
                Err(_) => {
                    crate::observe::store_failed("purge");
                    return Err("a batch took longer than 30 s; given up".to_owned());
                }
            };
            purged += deleted;
            // Counted batch by batch: a round that fails midway deleted these all the same.
            crate::observe::purged(deleted);
            if deleted < BATCH as u64 {
                return Ok(purged);
            }
            tokio::time::sleep(started.elapsed()).await;
        }
    }

    /// One rotation of the generations (nothing without them), in this replica's
    /// turn: see `Rotator::round`.
    pub(super) async fn rotate(&self) -> Result<GenerationRotation, String> {
        let Some(rotator) = &self.rotator else {
            return Ok(GenerationRotation::default());
        };
        // Responses past their TTL dropped first, their keys remembered.
        if let Some(reduce) = &rotator.reduce {
            self.batches(reduce).await?;
        }
        // Bounded as a batch is: a detach waits for the transactions that may still
        // read its partition, and one given up on is finished in a later round.
        let rotated = tokio::time::timeout(
            BATCH_BOUND,
            rotator.round(
                &super::rotate::OnPool {
                    pool: &self.pool,
                    connector: self.connector.as_ref(),
                },
                self.lock,
            ),
        )
        .await
        .unwrap_or_else(|_| Err("a rotation took longer than 30 s; given up".to_owned()));
        if rotated.is_err() {
            crate::observe::store_failed("purge");
        }
        rotated
    }

    /// Whether the table is in generations.
    pub(super) fn rotates(&self) -> bool {
        self.rotator.is_some()
    }

    /// The period of the generations, if the table has them.
    pub(super) fn generations(&self) -> Option<Duration> {
        self.rotator.as_ref().map(|r| r.period)
    }

    /// Forgets up to a batch of transactional mode's stale steps; a failure is tried
    /// again next round.
    async fn forget_stale_steps(&self) {
        let forgotten = async {
            let client = self.pool.get().await.map_err(|e| e.to_string())?;
            let conn = Checkout(Some(client), self.connector.clone());
            let done = conn.batch_execute(&self.forget_stale_steps).await;
            conn.done();
            done.map_err(|e| describe(&e))
        };
        match tokio::time::timeout(BATCH_BOUND, forgotten).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::debug!(error = %e, "stale steps could not be forgotten"),
            Err(_) => tracing::debug!("forgetting stale steps took longer than 30 s; given up"),
        }
    }

    /// One batch, on a pooled connection that goes back to the pool once answered (and
    /// is closed instead, its statement cancelled, if the batch is given up on: a
    /// [`Checkout`]).
    async fn batch(&self, statement: &Statement) -> Result<u64, String> {
        let client = self.pool.get().await.map_err(|e| e.to_string())?;
        let conn = Checkout(Some(client), self.connector.clone());
        let params: [&(dyn ToSql + Sync); 2] = [&BATCH, &self.lock];
        let deleted = if self.prepared {
            let prepared = conn
                .prepare_cached(statement)
                .await
                .map_err(|e| describe(&e))?;
            conn.execute(&prepared, &params).await
        } else {
            let typed = sql::typed(statement, &params);
            conn.execute_typed(statement, &typed).await
        };
        conn.done();
        deleted.map_err(|e| describe(&e))
    }
}

/// The purger's loop: a round every `every`, jittered, for as long as its store lives.
async fn run(purge: Weak<BackgroundPurge>, every: Duration) {
    loop {
        tokio::time::sleep(jittered(every, crate::random::u64())).await;
        let Some(purge) = purge.upgrade() else {
            return;
        };
        match purge.round().await {
            Ok(0) => {}
            Ok(emptied) if purge.rotates() => {
                tracing::debug!(emptied, "emptied generations of idempotency records");
            }
            Ok(purged) => tracing::debug!(purged, "purged expired idempotency records"),
            Err(e) => tracing::warn!(error = %e, "purging expired idempotency records failed"),
        }
    }
}

/// `every`, give or take a fifth, by `random`.
fn jittered(every: Duration, random: u64) -> Duration {
    // 0.8 to 1.2 times the period, in thousandths.
    let per_mille = 800 + random % 401;
    every.mul_f64(per_mille as f64 / 1000.0)
}

/// The advisory lock id of the purge of `table`: the first 8 bytes of its SHA-256.
pub(super) fn lock_id(table: &str) -> i64 {
    use sha2::{Digest, Sha256};
    let digest = Sha256::digest(format!("tower-idempotency purge {table}"));
    let mut id = [0; 8];
    id.copy_from_slice(&digest[..8]);
    i64::from_be_bytes(id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_are_spread_around_the_period() {
        let every = Duration::from_secs(60);
        assert_eq!(jittered(every, 0), Duration::from_secs(48));
        assert_eq!(jittered(every, 400), Duration::from_secs(72));
        assert_eq!(jittered(every, 401), Duration::from_secs(48));
        for random in [1, 77, 12_345, u64::MAX] {
            let wait = jittered(every, random);
            assert!(wait >= Duration::from_secs(48) && wait <= Duration::from_secs(72));
        }
    }

    #[test]
    fn tables_have_locks_of_their_own() {
        assert_ne!(lock_id("\"a\".\"t\""), lock_id("\"b\".\"t\""));
        assert_eq!(lock_id("\"a\".\"t\""), lock_id("\"a\".\"t\""));
    }
}
