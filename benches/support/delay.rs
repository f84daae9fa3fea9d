//! A database across a network, on one machine: a TCP proxy in a process of its own that
//! holds every chunk of bytes, in each direction, for a fixed delay before passing it on
//! (`BENCH_DB_DELAY_US`), so that each round trip to PostgreSQL takes twice that more.
//!
//! The benchmark starts it by running its own executable again with `DELAY_PROXY_UPSTREAM`
//! set; [`serve_if_asked`] is the first thing `main` calls, and serves instead of
//! benchmarking when that variable is there. A process of its own keeps the proxy's CPU
//! out of the benchmark's own count (it shows in `other_cpu`), and its threads block on
//! the sockets and sleep with the kernel's timer, which is finer than Tokio's millisecond.
//! Order is kept: each direction has one reader and one writer, and a chunk is written
//! only after those read before it.

use std::{
    io::{BufRead, BufReader, Read, Write},
    net::{Shutdown, SocketAddr, TcpListener, TcpStream},
    process::{Child, Command, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

const UPSTREAM: &str = "DELAY_PROXY_UPSTREAM";
const DELAY: &str = "DELAY_PROXY_DELAY_US";

/// The proxy process; killed when dropped.
pub(crate) struct DelayProxy {
    pub(crate) addr: SocketAddr,
    child: Child,
}

impl Drop for DelayProxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl DelayProxy {
    /// Starts a proxy to `upstream` that delays each direction by `delay`.
    pub(crate) fn start(upstream: SocketAddr, delay: Duration) -> Self {
        let mut child = Command::new(std::env::current_exe().expect("current_exe"))
            .env(UPSTREAM, upstream.to_string())
            .env(DELAY, delay.as_micros().to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start the delay proxy");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("stdout"))
            .read_line(&mut line)
            .expect("the delay proxy's address");
        let addr = line
            .trim()
            .parse()
            .expect("the delay proxy prints its address");
        Self { addr, child }
    }
}

/// Serves as the proxy, and never returns, if this process was started as one.
pub(crate) fn serve_if_asked() {
    let Ok(upstream) = std::env::var(UPSTREAM) else {
        return;
    };
    let upstream: SocketAddr = upstream.parse().expect("DELAY_PROXY_UPSTREAM");
    let delay = Duration::from_micros(
        std::env::var(DELAY)
            .expect("DELAY_PROXY_DELAY_US")
            .parse()
            .expect("DELAY_PROXY_DELAY_US"),
    );
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    println!("{}", listener.local_addr().expect("local_addr"));
    std::io::stdout().flush().expect("stdout");
    for client in listener.incoming() {
        let Ok(client) = client else { continue };
        let Ok(server) = TcpStream::connect(upstream) else {
            continue;
        };
        for s in [&client, &server] {
            s.set_nodelay(true).expect("nodelay");
        }
        let (c, s) = (
            client.try_clone().expect("clone"),
            server.try_clone().expect("clone"),
        );
        forward(client, server, delay);
        forward(s, c, delay);
    }
    std::process::exit(0);
}

/// One direction: `from` → `to`, each chunk held until `delay` after it was read.
fn forward(mut from: TcpStream, mut to: TcpStream, delay: Duration) {
    let (tx, rx) = mpsc::channel::<(Instant, Vec<u8>)>();
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if tx
                        .send((Instant::now() + delay, buf[..n].to_vec()))
                        .is_err()
                    {
                        break;
                    }
                }
            }
        }
        // The writer finishes what it holds, then closes its side.
    });
    std::thread::spawn(move || {
        for (due, bytes) in rx {
            let now = Instant::now();
            if due > now {
                std::thread::sleep(due - now);
            }
            if to.write_all(&bytes).is_err() {
                break;
            }
        }
        let _ = to.shutdown(Shutdown::Write);
    });
}
