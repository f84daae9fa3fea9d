//! One `LISTEN` connection per store, its notifications fanned out in-process.
//!
//! A waiting request marks the row (`waiters`); completion and release of a marked row
//! fire `pg_notify(channel, key id)` in the same statement, so the notification is
//! delivered when (and only if) the change commits, to every
//! process listening, which wakes the requests waiting on that key id alone. Waiters
//! register *before* the claim that finds a key running, so no wake-up can fall
//! between the claim and the wait.

use std::{
    sync::{
        Arc, Mutex, PoisonError, Weak,
        atomic::{AtomicU64, Ordering},
    },
    task::Poll,
    time::Duration,
};

use tokio_postgres::AsyncMessage;

use super::{errors::Shown, hosts::Hosts, tls::Connector};
use crate::store::{BoxFuture, waiters::Waiters};

/// How often a waiter looks again while no listener connection is up.
const FALLBACK_RECHECK: Duration = Duration::from_millis(250);

/// How often the listener checks that notifications still reach it. A connection
/// dropped silently (a NAT's or load balancer's idle timeout, a failover) would
/// otherwise look connected for as long as TCP keepalive takes, two hours by default,
/// while waiters waited for notifications that never come.
///
/// The check is a notification the listener sends itself, on a channel of its own that
/// it listens on with the store's (in the same statement, so on the same session), and
/// which must come back: a connection that answers statements but is not sent
/// notifications (through a transaction-pooling PgBouncer, whose server connection
/// holding the `LISTEN` is not the one it talks to) fails it too, and waiters look
/// again on their timer. No other listener receives it (PostgreSQL still wakes every
/// listening backend of the database to read its queue, as for any notification).
const HEARTBEAT: Duration = Duration::from_secs(10);

/// How long that check may take before the connection counts as lost.
const HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(5);

/// How long the listener may take to connect (as a pool of `pool_for_url` may).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// What the listener's connection gave it.
// Lives for one turn of the loop, on the stack: boxing the message would allocate for
// every notification to save nothing.
#[allow(clippy::large_enum_variant)]
enum Event {
    Message(Option<Result<AsyncMessage, tokio_postgres::Error>>),
    /// The heartbeat went unanswered.
    Silent,
    /// `LISTEN` failed (on a standby during a failover, say), went unanswered, or
    /// its first check did not come back.
    NotListening(String),
}

pub(super) struct Listener {
    /// Where to connect: the hosts of the store's notification configuration, which
    /// remember the one that last gave a connection (after a failover, the new primary).
    hosts: Option<Arc<Hosts>>,
    connector: Connector,
    channel: String,
    waiters: Arc<Waiters<String>>,
    started: Mutex<Option<tokio::task::AbortHandle>>,
    connected: tokio::sync::watch::Sender<bool>,
    pub(super) notifications: AtomicU64,
    pub(super) notified_wakeups: AtomicU64,
    pub(super) timer_wakeups: AtomicU64,
    /// How many times every waiter was woken at once (the listener connected or lost
    /// its connection): a waiter woken so was not woken by a notification.
    wake_alls: AtomicU64,
}

impl Drop for Listener {
    fn drop(&mut self) {
        if let Ok(mut started) = self.started.lock()
            && let Some(task) = started.take()
        {
            task.abort();
        }
    }
}

impl Listener {
    pub(super) fn new(
        config: Option<tokio_postgres::Config>,
        channel: String,
        connector: Connector,
    ) -> Self {
        Self {
            hosts: config.as_ref().map(|config| Arc::new(Hosts::new(config))),
            connector,
            channel,
            waiters: Arc::default(),
            started: Mutex::new(None),
            connected: tokio::sync::watch::channel(false).0,
            notifications: AtomicU64::new(0),
            notified_wakeups: AtomicU64::new(0),
            timer_wakeups: AtomicU64::new(0),
            wake_alls: AtomicU64::new(0),
        }
    }

    /// Wakes every waiter, to look again: nothing was heard of their keys.
    fn wake_everyone(&self) {
        self.wake_alls.fetch_add(1, Ordering::SeqCst);
        self.waiters.wake_all();
    }

    pub(super) fn channel(&self) -> &str {
        &self.channel
    }

    pub(super) fn is_connected(&self) -> bool {
        *self.connected.borrow()
    }

    /// Starts the listener if needed and waits until it listens; `false` if it has no
    /// connection settings or is not listening within `bound`.
    pub(super) async fn listening(self: &Arc<Self>, bound: Duration) -> bool {
        self.ensure_started();
        let mut rx = self.connected.subscribe();
        self.hosts.is_some()
            && tokio::time::timeout(bound, rx.wait_for(|up| *up))
                .await
                .is_ok_and(|r| r.is_ok())
    }

    /// Starts the listener task on first use (needs a Tokio runtime).
    fn ensure_started(self: &Arc<Self>) {
        let Some(hosts) = self.hosts.clone() else {
            return;
        };
        // Outside a runtime nothing can be spawned: waiters look again on their timer.
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let mut started = self.started.lock().unwrap_or_else(PoisonError::into_inner);
        // Started again if it has ended: the runtime that ran it shut down while the
        // store lives on (a store kept in a static, or handed from one runtime to
        // another), or it panicked.
        if started
            .as_ref()
            .is_none_or(tokio::task::AbortHandle::is_finished)
        {
            let task = runtime.spawn(listen(
                Arc::downgrade(self),
                hosts,
                self.connector.clone(),
                self.channel.clone(),
            ));
            *started = Some(task.abort_handle());
        }
    }

    /// A future that resolves when `id` may have changed. Registers now, not when
    /// first polled.
    pub(super) fn changed(self: &Arc<Self>, id: String) -> BoxFuture<'static, ()> {
        self.ensure_started();
        let wake_alls = self.wake_alls.load(Ordering::SeqCst);
        let notified = self.waiters.wait(id);
        let me = self.clone();
        let connected = self.is_connected();
        let woken = move |me: &Listener| {
            if me.wake_alls.load(Ordering::SeqCst) == wake_alls {
                me.notified_wakeups.fetch_add(1, Ordering::Relaxed);
            }
        };
        Box::pin(async move {
            if connected {
                notified.await;
                woken(&me);
                return;
            }
            // No listener yet (or it is reconnecting): look again now and then.
            tokio::select! {
                () = notified => woken(&me),
                () = tokio::time::sleep(FALLBACK_RECHECK) => {
                    me.timer_wakeups.fetch_add(1, Ordering::Relaxed);
                }
            }
        })
    }
}

/// Held by the listener task: however it ends (its runtime shut down, a panic, an
/// abort), the store stops counting as listening, and every waiter looks again and
/// falls back to its timer, instead of waiting out its bound for a notification that
/// nobody is left to hear.
struct Stopped(Weak<Listener>);

impl Drop for Stopped {
    fn drop(&mut self) {
        if let Some(me) = self.0.upgrade() {
            me.connected.send_replace(false);
            me.wake_everyone();
        }
    }
}

async fn listen(me: Weak<Listener>, hosts: Arc<Hosts>, connector: Connector, channel: String) {
    let _stopped = Stopped(me.clone());
    let mut backoff = Duration::from_millis(100);
    loop {
        // Bounded: a host that accepts and never answers (a primary frozen or cut off
        // in a failover) would hold the listener for good, and every waiter on its timer.
        let connected = tokio::time::timeout(CONNECT_TIMEOUT, connector.connect(&hosts)).await;
        match connected {
            Ok(Ok((client, mut connection))) => {
                // Unique to this connection, so that nobody else hears its checks, and
                // no earlier connection's passes for this one's.
                let echo = format!("ti_echo_{:016x}", crate::random::u64());
                let listen = format!("LISTEN \"{channel}\"; LISTEN \"{echo}\"");
                let check_sql = format!("NOTIFY \"{echo}\"");
                let echoed = tokio::sync::Notify::new();
                // A notification of our own, sent and heard back within the bound.
                let heard_back = || async {
                    client.batch_execute(&check_sql).await.is_ok() && {
                        echoed.notified().await;
                        true
                    }
                };
                // Listening counts from the first check heard back; bounded like a
                // heartbeat: an answer lost on the way must not leave the connection
                // up but deaf, with nothing left to notice.
                let mut listening = Box::pin(tokio::time::timeout(HEARTBEAT_TIMEOUT, async {
                    client.batch_execute(&listen).await?;
                    Ok::<bool, tokio_postgres::Error>(heard_back().await)
                }));
                let mut subscribed = false;
                let mut heartbeat =
                    tokio::time::interval_at(tokio::time::Instant::now() + HEARTBEAT, HEARTBEAT);
                heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                let mut check: Option<BoxFuture<'_, bool>> = None;
                loop {
                    let event = std::future::poll_fn(|cx| {
                        if !subscribed
                            && let Poll::Ready(r) = listening.as_mut().poll(cx) {
                                let failed = match r {
                                    Ok(Ok(true)) => None,
                                    Ok(Ok(false)) => Some("the check after LISTEN failed".to_owned()),
                                    Ok(Err(e)) => Some(Shown(&e).to_string()),
                                    Err(_) => Some(
                                        "no answer to LISTEN, or the notification it sent itself did not come back (through a transaction-pooling PgBouncer, say)"
                                            .to_owned(),
                                    ),
                                };
                                if let Some(error) = failed {
                                    return Poll::Ready(Event::NotListening(error));
                                }
                                subscribed = true;
                                if let Some(me) = me.upgrade() {
                                    me.connected.send_replace(true);
                                    backoff = Duration::from_millis(100);
                                    // Anything may have completed while we were away.
                                    me.wake_everyone();
                                }
                            }
                        if subscribed {
                            // Ends with the running check or the timer pending, so one of
                            // them wakes the task: the timer is polled as soon as the
                            // connection listens, and again after each check comes back.
                            loop {
                                if let Some(running) = check.as_mut() {
                                    match running.as_mut().poll(cx) {
                                        Poll::Ready(true) => check = None,
                                        Poll::Ready(false) => return Poll::Ready(Event::Silent),
                                        Poll::Pending => break,
                                    }
                                } else if heartbeat.poll_tick(cx).is_ready() {
                                    check = Some(Box::pin(async {
                                        tokio::time::timeout(HEARTBEAT_TIMEOUT, heard_back())
                                            .await
                                            .unwrap_or(false)
                                    }));
                                } else {
                                    break;
                                }
                            }
                        }
                        connection.poll_message(cx).map(Event::Message)
                    })
                    .await;
                    let Some(me) = me.upgrade() else { return };
                    match event {
                        Event::Message(Some(Ok(AsyncMessage::Notification(n))))
                            if n.channel() == echo =>
                        {
                            echoed.notify_one();
                        }
                        Event::Message(Some(Ok(AsyncMessage::Notification(n)))) => {
                            me.notifications.fetch_add(1, Ordering::Relaxed);
                            me.waiters.wake(n.payload());
                        }
                        Event::Message(Some(Ok(_))) => {}
                        Event::Message(Some(Err(e))) => {
                            tracing::warn!(error = %Shown(&e), "the idempotency listener connection failed");
                            break;
                        }
                        Event::Message(None) => break,
                        Event::Silent => {
                            tracing::warn!(
                                "the idempotency listener connection stopped answering, or its notifications stopped arriving; reconnecting"
                            );
                            break;
                        }
                        Event::NotListening(error) => {
                            tracing::warn!(%error, "the idempotency listener could not LISTEN; reconnecting");
                            break;
                        }
                    }
                }
                if let Some(me) = me.upgrade() {
                    me.connected.send_replace(false);
                    me.wake_everyone();
                }
            }
            Ok(Err(e)) => {
                tracing::warn!(error = %Shown(&e), "the idempotency listener cannot connect");
            }
            Err(_) => tracing::warn!(
                "the idempotency listener cannot connect: no connection within {} s",
                CONNECT_TIMEOUT.as_secs()
            ),
        }
        if me.strong_count() == 0 {
            return;
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(5));
    }
}
