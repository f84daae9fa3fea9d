//! What a holder of lease-mode claims does whichever driver holds its lock
//! (`liveness` for tokio-postgres, `store/sqlx/liveness` for sqlx): its id, the
//! settings of its lock's session, how long it may be silent, and when its heartbeat
//! renews `seen_at` (while it runs claims, every `HEARTBEAT`), and the task that holds
//! its lock: when it starts, whether the lock is held, why it is not. A driver owns the
//! connections: the one that holds the lock and the heartbeat's.

use std::{
    sync::{
        Arc, Mutex, PoisonError, Weak,
        atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering},
    },
    time::Duration,
};

use tokio::{sync::watch, task::AbortHandle, time::Instant};

use crate::store::{BoxFuture, StoreError, StoreErrorKind};

/// How long a holder must have been silent, its lock free, before its claims are
/// taken over; and how long after its claim a claim is never taken over so.
pub(crate) const GRACE: Duration = Duration::from_secs(1);

/// How often a holder running claims renews its `seen_at`: four times within `GRACE`,
/// so that one renewal late or lost does not make it look silent.
const HEARTBEAT: Duration = Duration::from_millis(250);

/// How long the liveness connection may take to connect.
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// The longest wait between two attempts to connect.
pub(crate) const MAX_BACKOFF: Duration = Duration::from_secs(1);

/// The liveness connection's session settings: nothing of the server's or the role's
/// ends it while it idles (its statement waits for its own lock as long as it takes),
/// and the server's TCP keepalive and user timeout are the kernel's own (hours), not a
/// shorter one of the server's configuration, which would end it, and free its lock,
/// in a partition shorter than the lease. Only the settings this server has are set.
pub(crate) const SETTINGS: &str = "SELECT set_config(name, '0', false) FROM pg_settings
     WHERE name IN ('statement_timeout', 'lock_timeout', 'idle_in_transaction_session_timeout',
                    'idle_session_timeout', 'transaction_timeout', 'tcp_keepalives_idle',
                    'tcp_keepalives_interval', 'tcp_keepalives_count', 'tcp_user_timeout')";

/// How long `start_liveness` waits for the lock to be held.
const START_BOUND: Duration = Duration::from_secs(5);

/// A new holder id: positive and never 0, like a fencing token; any 63-bit number
/// would do.
pub(crate) fn new_holder_id() -> i64 {
    ((crate::random::u64() >> 1) as i64).max(1)
}

/// The heartbeat's statement, a simple query (the id is the store's own number):
/// `holder`'s `seen_at` in `holders` renewed.
pub(crate) fn heartbeat_statement(holders: &str, holder: i64) -> String {
    format!("UPDATE {holders} SET seen_at = now() WHERE holder = {holder}")
}

/// The task that holds a holder's lock, as each driver runs it.
pub(crate) trait Hold: Send + Sync + 'static {
    /// The task's state.
    fn holding(&self) -> &Holding;
    /// Holds the lock on a connection of its own for as long as the holder lives
    /// (`me`, not kept across a wait, so that the holder may go meanwhile), telling
    /// its `holding` when the lock is held, lost, or failed to be held.
    fn hold(me: Weak<Self>) -> BoxFuture<'static, ()>;
}

/// Where the task that holds a holder's lock is: whether it runs, whether the lock is
/// held and the holder registered, and why its connection last failed to. The task
/// stops with the holder.
pub(crate) struct Holding {
    /// The task, and whether it runs (read by every claim, so without the lock).
    task: Mutex<Option<AbortHandle>>,
    running: AtomicBool,
    /// Whether the lock is held and the holder registered.
    held: watch::Sender<bool>,
    /// Why the connection last failed to hold its lock and register, until it does:
    /// what `start_liveness` says when it gives up.
    failed: Mutex<Option<StoreError>>,
}

impl Default for Holding {
    fn default() -> Self {
        Self {
            task: Mutex::new(None),
            running: AtomicBool::new(false),
            held: watch::channel(false).0,
            failed: Mutex::new(None),
        }
    }
}

impl Drop for Holding {
    fn drop(&mut self) {
        if let Some(task) = self
            .task
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
        {
            task.abort();
        }
    }
}

impl Holding {
    /// Whether the lock is held and the holder registered.
    pub(crate) fn is_held(&self) -> bool {
        *self.held.borrow()
    }

    /// The lock is held and the holder registered.
    pub(crate) fn held(&self) {
        *self.failed.lock().unwrap_or_else(PoisonError::into_inner) = None;
        self.held.send_replace(true);
    }

    /// The connection that held the lock ended.
    pub(crate) fn lost(&self) {
        self.held.send_replace(false);
    }

    /// The connection failed to hold the lock and register, with `e`.
    pub(crate) fn failed(&self, e: StoreError) {
        *self.failed.lock().unwrap_or_else(PoisonError::into_inner) = Some(e);
    }
}

/// Starts the task that holds `holder`'s lock, if it is not running (needs a runtime;
/// it runs on the one that first calls this, and again on the next if that one ended).
pub(crate) fn start<H: Hold>(holder: &Arc<H>) {
    let holding = holder.holding();
    if holding.running.load(Ordering::Acquire) {
        return;
    }
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    let mut task = holding.task.lock().unwrap_or_else(PoisonError::into_inner);
    if !holding.running.load(Ordering::Acquire) {
        holding.running.store(true, Ordering::Release);
        let me = Arc::downgrade(holder);
        let spawned = runtime.spawn(async move {
            let _released = Released(me.clone());
            H::hold(me).await;
        });
        *task = Some(spawned.abort_handle());
    }
}

/// Held by the task that holds the lock: however it ends (its runtime shut down, say),
/// the holder stops counting as held, and the next claim starts the task again.
struct Released<H: Hold>(Weak<H>);

impl<H: Hold> Drop for Released<H> {
    fn drop(&mut self) {
        if let Some(me) = self.0.upgrade() {
            let holding = me.holding();
            holding.held.send_replace(false);
            holding.running.store(false, Ordering::Release);
        }
    }
}

/// What `start_liveness` does: starts the task and waits (up to 5 s) until the lock is
/// held and the holder registered; else why its connection last failed (`not_held`).
pub(crate) async fn started<H: Hold>(holder: &Arc<H>) -> Result<(), StoreError> {
    start(holder);
    let holding = holder.holding();
    let mut rx = holding.held.subscribe();
    let held = tokio::time::timeout(START_BOUND, rx.wait_for(|held| *held))
        .await
        .is_ok_and(|r| r.is_ok());
    if held {
        return Ok(());
    }
    Err(not_held(
        holding
            .failed
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .map(StoreError::copied),
    ))
}

/// The heartbeat of a holder's `seen_at`, as each driver renews it.
pub(crate) trait Beat: Send + Sync + 'static {
    /// The holder's activity.
    fn activity(&self) -> &Activity;
    /// Renews `seen_at` once, on a connection that does not wait for the app's pool.
    fn renew_seen_at(&self) -> BoxFuture<'_, Result<(), StoreError>>;
}

/// Whether a holder runs claims, and so whether its heartbeat goes on; and what it
/// counts.
pub(crate) struct Activity {
    /// Claims acquired and not yet completed or released.
    running: AtomicUsize,
    /// Until when the heartbeat goes on (ms from `epoch`): a lease after the last
    /// claim or renewal, so that a claim its owner forgot ends it all the same.
    active_until: AtomicU64,
    epoch: Instant,
    /// Whether a heartbeat task runs.
    beating: AtomicBool,
    /// Whether a heartbeat's failure that a retry will not mend (a right missing, say)
    /// was logged as a warning since the last heartbeat that went through.
    warned: AtomicBool,
    pub(crate) heartbeats: AtomicU64,
    pub(crate) takeovers: AtomicU64,
}

impl Default for Activity {
    fn default() -> Self {
        Self {
            running: AtomicUsize::new(0),
            active_until: AtomicU64::new(0),
            epoch: Instant::now(),
            beating: AtomicBool::new(false),
            warned: AtomicBool::new(false),
            heartbeats: AtomicU64::new(0),
            takeovers: AtomicU64::new(0),
        }
    }
}

impl Activity {
    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// The heartbeat goes on until `lease` from now at least.
    fn extend(&self, lease: Duration) {
        let until = self
            .now_ms()
            .saturating_add(u64::try_from(lease.as_millis()).unwrap_or(u64::MAX));
        self.active_until.fetch_max(until, Ordering::AcqRel);
    }

    /// Whether the holder runs claims, as far as it knows.
    fn active(&self) -> bool {
        self.running.load(Ordering::Acquire) > 0
            && self.now_ms() < self.active_until.load(Ordering::Acquire)
    }

    /// A claim was completed or released (or found lost).
    pub(crate) fn ended(&self) {
        let _ = self
            .running
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
    }
}

/// A claim of `lease` was acquired by `holder`: the heartbeat runs while it does.
pub(crate) fn acquired<B: Beat>(holder: &Arc<B>, lease: Duration) {
    holder.activity().running.fetch_add(1, Ordering::AcqRel);
    holder.activity().extend(lease);
    beat(holder);
}

/// A claim of `holder` was renewed for `lease`.
pub(crate) fn renewed<B: Beat>(holder: &Arc<B>, lease: Duration) {
    holder.activity().extend(lease);
    beat(holder);
}

/// Starts the heartbeat task unless one runs.
fn beat<B: Beat>(holder: &Arc<B>) {
    let activity = holder.activity();
    if activity.beating.load(Ordering::Acquire) || activity.beating.swap(true, Ordering::AcqRel) {
        return;
    }
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        activity.beating.store(false, Ordering::Release);
        return;
    };
    runtime.spawn(heartbeat(holder.clone()));
}

/// Renews the holder's `seen_at` every `HEARTBEAT` while the store runs claims. The
/// first renewal comes a `HEARTBEAT` after the claim that started it (the claim's own
/// time stands for it until `GRACE`): a store whose handlers take less never renews.
/// Each renewal is bounded by `GRACE`; one that takes longer is dropped with its
/// connection.
async fn heartbeat<B: Beat>(holder: Arc<B>) {
    loop {
        tokio::time::sleep(HEARTBEAT).await;
        let activity = holder.activity();
        if !activity.active() {
            activity.beating.store(false, Ordering::Release);
            // A claim that came in between, and found the task still beating, did not
            // start another: this one goes on for it.
            if !activity.active() || activity.beating.swap(true, Ordering::AcqRel) {
                return;
            }
        }
        match tokio::time::timeout(GRACE, holder.renew_seen_at()).await {
            Ok(Ok(())) => {
                activity.heartbeats.fetch_add(1, Ordering::Relaxed);
                activity.warned.store(false, Ordering::Relaxed);
            }
            // One that a retry will not mend (a right missing, the table not migrated,
            // the app's session setup refused) is said once, loudly.
            Ok(Err(e))
                if e.kind() == StoreErrorKind::Misconfigured
                    && !activity.warned.swap(true, Ordering::Relaxed) =>
            {
                tracing::warn!(error = %e, "a liveness heartbeat failed");
            }
            Ok(Err(e)) => tracing::debug!(error = %e, "a liveness heartbeat failed"),
            Err(_) => tracing::debug!("a liveness heartbeat went unanswered"),
        }
    }
}

/// The next wait before connecting again, after a failure.
pub(crate) fn backoff_after(backoff: Duration) -> Duration {
    (backoff * 2).clamp(Duration::from_millis(50), MAX_BACKOFF)
}

/// What `start_liveness` says when the lock was not held within 5 s: why its
/// connection last failed, as the database said it, and what to do where the cause is
/// likely (the table not migrated, a right missing); `None`: it never said.
fn not_held(last: Option<StoreError>) -> StoreError {
    let Some(e) = last else {
        return StoreError::new(
            StoreErrorKind::Unavailable,
            "the liveness connection did not hold its lock within 5 s (has migrate() run?)",
        );
    };
    let said = StoreError::new(
        e.kind(),
        format!(
            "the liveness connection did not hold its lock within 5 s: {}",
            e.source
        ),
    );
    match e.hint() {
        Some(hint) => said.with_hint(hint.to_owned()),
        None => said,
    }
}
