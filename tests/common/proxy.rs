//! A TCP proxy between a pool and PostgreSQL that reads the wire protocol: it counts the
//! statements executed (`Execute` and simple `Query` messages, not `Parse`), and can
//! stall traffic, drop the connections open at a moment silently, lose a `COMMIT` or
//! its answer, hold one connection at its `COMMIT` or `ROLLBACK`, make `LISTEN` or
//! `BEGIN` fail, make `LISTEN` listen elsewhere, or refuse new ones.

use std::{
    net::SocketAddr,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering},
    },
    time::Duration,
};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream, tcp::OwnedReadHalf, tcp::OwnedWriteHalf},
};

use super::database_url;

/// The addresses of the proxies started in this process (see [`is_proxied`]).
static PROXIES: Mutex<Vec<SocketAddr>> = Mutex::new(Vec::new());

/// Whether `url` names a host that is one of this process's proxies.
pub fn is_proxied(url: &str) -> bool {
    PROXIES
        .lock()
        .expect("proxies")
        .iter()
        .any(|addr| url.contains(&addr.to_string()))
}

struct Shared {
    executes: AtomicU64,
    commits: AtomicU64,
    stalled: AtomicBool,
    /// Connections are numbered as they open; those below this pass nothing, for good.
    opened: AtomicU64,
    dead_below: AtomicU64,
    refusing: AtomicBool,
    refused: AtomicU64,
    /// Reads from clients, counted as they arrive (before any stall holds them).
    received: AtomicU64,
    /// Set to close the connection that next hears from the server, unanswered.
    cut_at_reply: AtomicBool,
    /// Set to lose the server's answers on the connection that next sends `COMMIT`.
    lose_commit_reply: AtomicBool,
    /// Set to close the connection that next sends `COMMIT`, before it reaches the server.
    drop_commit: AtomicBool,
    /// Set to hold the connection that next sends `COMMIT` (`HOLD_*`).
    hold_commit: AtomicU8,
    /// Set to hold the connection that next sends `ROLLBACK` (`HOLD_*`).
    hold_rollback: AtomicU8,
    /// The connections held so far, until `release_held`.
    held: Mutex<Vec<Arc<Held>>>,
    /// While set, `LISTEN` reaches the server misspelt, and fails there.
    breaking_listen: AtomicBool,
    /// While set, `LISTEN` reaches the server on another channel, and succeeds there.
    deafening_listen: AtomicBool,
    /// While set, a simple query that starts with `BEGIN` reaches the server misspelt,
    /// and fails there.
    breaking_begin: AtomicBool,
    /// Bumped to close every open connection at once.
    cuts: tokio::sync::watch::Sender<u64>,
}

pub struct PgProxy {
    pub addr: SocketAddr,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for PgProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn upstream() -> (SocketAddr, tokio_postgres::Config) {
    let config: tokio_postgres::Config = database_url().parse().expect("DATABASE_URL");
    let host = match config.get_hosts().first() {
        Some(tokio_postgres::config::Host::Tcp(h)) => h.clone(),
        other => panic!("the proxy needs a TCP host in DATABASE_URL, got {other:?}"),
    };
    let port = config.get_ports().first().copied().unwrap_or(5432);
    let host = if host == "localhost" {
        "127.0.0.1".to_owned()
    } else {
        host
    };
    (format!("{host}:{port}").parse().expect("host:port"), config)
}

impl PgProxy {
    pub async fn start() -> Self {
        let (upstream, _) = upstream();
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        PROXIES.lock().expect("proxies").push(addr);
        let shared = Arc::new(Shared {
            executes: AtomicU64::new(0),
            commits: AtomicU64::new(0),
            stalled: AtomicBool::new(false),
            opened: AtomicU64::new(0),
            dead_below: AtomicU64::new(0),
            refusing: AtomicBool::new(false),
            refused: AtomicU64::new(0),
            received: AtomicU64::new(0),
            cut_at_reply: AtomicBool::new(false),
            lose_commit_reply: AtomicBool::new(false),
            breaking_listen: AtomicBool::new(false),
            deafening_listen: AtomicBool::new(false),
            breaking_begin: AtomicBool::new(false),
            drop_commit: AtomicBool::new(false),
            hold_commit: AtomicU8::new(NO_HOLD),
            hold_rollback: AtomicU8::new(NO_HOLD),
            held: Mutex::new(Vec::new()),
            cuts: tokio::sync::watch::channel(0).0,
        });
        let s = shared.clone();
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                if s.refusing.load(Ordering::SeqCst) {
                    s.refused.fetch_add(1, Ordering::SeqCst);
                    drop(client);
                    continue;
                }
                let s = s.clone();
                let id = s.opened.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(upstream).await else {
                        return;
                    };
                    let (cr, cw) = client.into_split();
                    let (sr, sw) = server.into_split();
                    let mut cut = s.cuts.subscribe();
                    let lost = Arc::new(AtomicBool::new(false));
                    let held = Arc::new(Held::default());
                    let up = tokio::spawn(pump_frontend(
                        cr,
                        sw,
                        s.clone(),
                        id,
                        lost.clone(),
                        held.clone(),
                    ));
                    let down = tokio::spawn(pump_backend(sr, cw, s, id, lost, held));
                    let (up_abort, down_abort) = (up.abort_handle(), down.abort_handle());
                    tokio::select! {
                        _ = async { let _ = tokio::join!(up, down); } => {}
                        _ = cut.changed() => {
                            // Both sockets are dropped with their tasks: the pool sees
                            // its connections die, as when the server restarts.
                            up_abort.abort();
                            down_abort.abort();
                        }
                    }
                });
            }
        });
        Self { addr, shared, task }
    }

    /// The database URL through this proxy, in plain text (`sslmode=disable`): the proxy
    /// reads the protocol, which TLS would hide from it, and refuses a client that asks
    /// for TLS (a driver built with a TLS stack asks by default: `sslmode=prefer`).
    pub fn url(&self) -> String {
        let (_, config) = upstream();
        let user = config.get_user().unwrap_or("postgres");
        let db = config.get_dbname().unwrap_or(user);
        let password = config
            .get_password()
            .map(|p| format!(":{}", String::from_utf8_lossy(p)))
            .unwrap_or_default();
        format!(
            "postgres://{user}{password}@{}/{db}?connect_timeout=2&sslmode=disable",
            self.addr
        )
    }

    /// A URL that names two hosts, the proxy, then the database itself, with
    /// `target_session_attrs=read-write`: as a primary and its standby are named, where
    /// the first can be made to fail while the second serves.
    pub fn url_then_the_database(&self) -> String {
        let (upstream, config) = upstream();
        let user = config.get_user().unwrap_or("postgres");
        let db = config.get_dbname().unwrap_or(user);
        let password = config
            .get_password()
            .map(|p| format!(":{}", String::from_utf8_lossy(p)))
            .unwrap_or_default();
        format!(
            "postgres://{user}{password}@{},{upstream}/{db}?target_session_attrs=read-write&sslmode=disable",
            self.addr
        )
    }

    /// Statements executed through the proxy so far.
    pub fn executes(&self) -> u64 {
        self.shared.executes.load(Ordering::SeqCst)
    }

    /// `COMMIT`s sent through the proxy so far.
    pub fn commits(&self) -> u64 {
        self.shared.commits.load(Ordering::SeqCst)
    }

    /// Holds every byte in both directions while `on`.
    pub fn stall(&self, on: bool) {
        self.shared.stalled.store(on, Ordering::SeqCst);
    }

    /// Every connection open now stops passing bytes in either direction, for good,
    /// and nothing fails: as when a NAT or a load balancer forgets them. Connections
    /// opened later pass as usual.
    pub fn blackhole(&self) {
        let opened = self.shared.opened.load(Ordering::SeqCst);
        self.shared.dead_below.store(opened, Ordering::SeqCst);
    }

    /// Closes the next connection the server answers, before the answer reaches the
    /// client: the statement ran, and the client cannot know it.
    pub fn cut_at_next_reply(&self) {
        self.shared.cut_at_reply.store(true, Ordering::SeqCst);
    }

    /// The next connection to send `COMMIT` passes it to the server, then hears nothing
    /// more and is closed: the server commits, and the client cannot know it.
    pub fn lose_next_commit_reply(&self) {
        self.shared.lose_commit_reply.store(true, Ordering::SeqCst);
    }

    /// The next connection to send `COMMIT` is closed instead, with what it sent along
    /// with it: the server rolls the transaction back, and the client cannot know it.
    pub fn drop_next_commit(&self) {
        self.shared.drop_commit.store(true, Ordering::SeqCst);
    }

    /// The next connection to send `COMMIT` stops passing bytes, both ways, from that
    /// `COMMIT` on, which the server does not get, until [`release_held`]: the
    /// connection stays open and nothing fails, as when a network partition or a frozen
    /// server holds it. The server keeps the transaction open, and its locks.
    ///
    /// [`release_held`]: Self::release_held
    pub fn hold_next_commit(&self) {
        self.shared.hold_commit.store(HOLD_BEFORE, Ordering::SeqCst);
    }

    /// The next connection to send `COMMIT` passes it to the server, then stops passing
    /// bytes, both ways, until [`release_held`]: the server commits, and its answer is
    /// held, as when a synchronous standby is gone or the link stalls on the way back.
    ///
    /// [`release_held`]: Self::release_held
    pub fn hold_after_next_commit(&self) {
        self.shared.hold_commit.store(HOLD_AFTER, Ordering::SeqCst);
    }

    /// As [`hold_next_commit`](Self::hold_next_commit), at the next `ROLLBACK`.
    pub fn hold_next_rollback(&self) {
        self.shared
            .hold_rollback
            .store(HOLD_BEFORE, Ordering::SeqCst);
    }

    /// Connections held at a `COMMIT` or `ROLLBACK` so far.
    pub fn held(&self) -> usize {
        self.shared.held.lock().expect("held").len()
    }

    /// Lets every held connection pass bytes again, what it held first.
    pub fn release_held(&self) {
        for held in self.shared.held.lock().expect("held").drain(..) {
            held.up.store(false, Ordering::SeqCst);
            held.down.store(false, Ordering::SeqCst);
        }
    }

    /// While `on`, every `LISTEN` fails at the server (as on a standby), with a
    /// syntax error: the proxy misspells it on the way.
    pub fn break_listen(&self, on: bool) {
        self.shared.breaking_listen.store(on, Ordering::SeqCst);
    }

    /// While `on`, every simple query that starts with `BEGIN` fails at the server, with
    /// a syntax error (the proxy misspells it on the way), before any of its statements
    /// runs: as one fails that a cancel request reaches as it starts (PostgreSQL checks
    /// for one before each statement of a query). The session lives on, outside any
    /// transaction.
    pub fn break_begin(&self, on: bool) {
        self.shared.breaking_begin.store(on, Ordering::SeqCst);
    }

    /// While `on`, every `LISTEN` succeeds on another channel than the one it names:
    /// the connection answers every statement, and hears no notification, as through
    /// a transaction-pooling PgBouncer.
    pub fn deafen_listen(&self, on: bool) {
        self.shared.deafening_listen.store(on, Ordering::SeqCst);
    }

    /// Closes every open connection now.
    pub fn cut(&self) {
        self.shared.cuts.send_modify(|n| *n += 1);
    }

    /// Closes new connections at once while `on`.
    pub fn refuse(&self, on: bool) {
        self.shared.refusing.store(on, Ordering::SeqCst);
    }

    /// Reads from clients so far, a stalled one included.
    pub fn received(&self) -> u64 {
        self.shared.received.load(Ordering::SeqCst)
    }

    /// Connections closed at once because they came while refusing.
    pub fn refused(&self) -> u64 {
        self.shared.refused.load(Ordering::SeqCst)
    }
}

/// No hold set.
const NO_HOLD: u8 = 0;
/// Hold the statement and everything after it.
const HOLD_BEFORE: u8 = 1;
/// Pass the statement, then hold everything after it.
const HOLD_AFTER: u8 = 2;

/// What one connection holds: client to server (`up`), server to client (`down`).
#[derive(Default)]
struct Held {
    up: AtomicBool,
    down: AtomicBool,
}

async fn wait_while_stalled(s: &Shared, id: u64, held: &AtomicBool) {
    while s.stalled.load(Ordering::SeqCst)
        || id < s.dead_below.load(Ordering::SeqCst)
        || held.load(Ordering::SeqCst)
    {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Holds `held` in the way `how` says, the statement about to be written up.
fn hold(s: &Shared, held: &Arc<Held>, how: u8) {
    if how == NO_HOLD {
        return;
    }
    held.down.store(true, Ordering::SeqCst);
    if how == HOLD_BEFORE {
        held.up.store(true, Ordering::SeqCst);
    }
    s.held.lock().expect("held").push(held.clone());
}

/// Client to server, parsed: an untyped start-up message (after any SSL/GSS request),
/// then typed messages `type, int32 length, payload`.
async fn pump_frontend(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    s: Arc<Shared>,
    id: u64,
    lost: Arc<AtomicBool>,
    held: Arc<Held>,
) {
    let mut buf = vec![0u8; 64 * 1024];
    let mut pending: Vec<u8> = Vec::new();
    let mut started = false;
    let mut dropping = false;
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        s.received.fetch_add(1, Ordering::SeqCst);
        wait_while_stalled(&s, id, &held.up).await;
        // Set by a held statement in this read: `up` is held after it is written.
        let mut hold_up_after = false;
        if s.breaking_listen.load(Ordering::SeqCst) {
            // Same length, so the message's framing holds.
            if let Some(at) = buf[..n].windows(8).position(|w| w == b"LISTEN \"") {
                buf[at + 5] = b'X';
            }
        }
        if s.breaking_begin.load(Ordering::SeqCst) {
            // A simple query's text starts after its type and length: same length.
            let begins: Vec<usize> = buf[..n]
                .windows(10)
                .enumerate()
                .filter(|(_, w)| w[0] == b'Q' && w[5..] == *b"BEGIN")
                .map(|(at, _)| at)
                .collect();
            for at in begins {
                buf[at + 9] = b'X';
            }
        }
        if s.deafening_listen.load(Ordering::SeqCst) {
            // Each channel's first letter, changed: same length, other channels.
            let listens: Vec<usize> = buf[..n]
                .windows(8)
                .enumerate()
                .filter(|(_, w)| *w == b"LISTEN \"")
                .map(|(at, _)| at)
                .collect();
            for at in listens {
                if let Some(letter) = buf[..n].get_mut(at + 8) {
                    *letter = if *letter == b'z' { b'y' } else { b'z' };
                }
            }
        }
        pending.extend_from_slice(&buf[..n]);
        loop {
            if !started {
                if pending.len() < 8 {
                    break;
                }
                let len =
                    u32::from_be_bytes([pending[0], pending[1], pending[2], pending[3]]) as usize;
                if pending.len() < len {
                    break;
                }
                let code = u32::from_be_bytes([pending[4], pending[5], pending[6], pending[7]]);
                // 80877103: SSLRequest, 80877104: GSSENCRequest; anything else starts up.
                // An encrypted session would hide every message this proxy reads (it
                // would count no COMMIT, lose none, hold none): the client is refused,
                // so that a test through the proxy fails at its connection, not later.
                if code == 80_877_103 || code == 80_877_104 {
                    eprintln!(
                        "the test proxy refused a client that asked for an encrypted session: connect through it with sslmode=disable"
                    );
                    dropping = true;
                    break;
                }
                started = true;
                pending.drain(..len);
            } else {
                if pending.len() < 5 {
                    break;
                }
                let len =
                    u32::from_be_bytes([pending[1], pending[2], pending[3], pending[4]]) as usize;
                if pending.len() < 1 + len {
                    break;
                }
                if pending[0] == b'E' || pending[0] == b'Q' {
                    s.executes.fetch_add(1, Ordering::SeqCst);
                }
                // A simple query carries its SQL text: count the COMMITs.
                if pending[0] == b'Q'
                    && pending[5..1 + len]
                        .to_ascii_uppercase()
                        .starts_with(b"COMMIT")
                {
                    s.commits.fetch_add(1, Ordering::SeqCst);
                    if s.lose_commit_reply.swap(false, Ordering::SeqCst) {
                        lost.store(true, Ordering::SeqCst);
                    }
                    if s.drop_commit.swap(false, Ordering::SeqCst) {
                        dropping = true;
                    }
                    let how = s.hold_commit.swap(NO_HOLD, Ordering::SeqCst);
                    hold(&s, &held, how);
                    hold_up_after |= how == HOLD_AFTER;
                }
                if pending[0] == b'Q'
                    && pending[5..1 + len]
                        .to_ascii_uppercase()
                        .starts_with(b"ROLLBACK")
                {
                    hold(&s, &held, s.hold_rollback.swap(NO_HOLD, Ordering::SeqCst));
                }
                pending.drain(..1 + len);
            }
        }
        if dropping {
            // Closed with the COMMIT (or the request for TLS) unsent: the server sees
            // the client go, and rolls back; the client sees the connection close.
            break;
        }
        // Held before this read reaches the server, if it holds a statement so.
        wait_while_stalled(&s, id, &held.up).await;
        if to.write_all(&buf[..n]).await.is_err() {
            break;
        }
        if hold_up_after {
            held.up.store(true, Ordering::SeqCst);
        }
    }
    let _ = to.shutdown().await;
}

async fn pump_backend(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    s: Arc<Shared>,
    id: u64,
    lost: Arc<AtomicBool>,
    held: Arc<Held>,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        wait_while_stalled(&s, id, &held.down).await;
        if lost.load(Ordering::SeqCst) {
            // The client is told the connection closed; the server's side stays open
            // and is drained, so that it runs what it was sent, COMMIT included.
            let _ = to.shutdown().await;
            while let Ok(n) = from.read(&mut buf).await {
                if n == 0 {
                    break;
                }
            }
            return;
        }
        if s.cut_at_reply.swap(false, Ordering::SeqCst) {
            // What the server answered is lost with the connection.
            break;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
}
