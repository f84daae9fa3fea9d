//! Connections to a URL that names several hosts: a primary and its standbys, with
//! `target_session_attrs=read-write`, so that after a failover new connections find
//! the promoted standby.
//!
//! tokio-postgres tries such hosts one after the other, each for as long as it takes:
//! its `connect_timeout` bounds the TCP connection alone, not the start-up that
//! follows. A primary gone without a word (its machine frozen, or cut off by the
//! network: connections accepted and never answered, or never accepted) holds every
//! attempt on the first host past the pool's create timeout and the request's store
//! timeout, so the next host, the new primary, is never reached, and every request
//! answers 503 for as long as the old primary stays away.
//!
//! Here an attempt starts from the host that gave the last connection, and a host that
//! has not given one within `HEAD_START` is raced by the next in the URL: the first to
//! connect, and pass `target_session_attrs`, wins, and the others are dropped. After a
//! failover the first connection to the new primary costs `HEAD_START` for each host
//! that does not answer before it; the next ones go to it straight away. A host that
//! refuses, or is not what `target_session_attrs` asks for, hands over at once. An
//! attempt given up on by its caller before any host answered (a store timeout shorter
//! than `HEAD_START`, say) makes the next attempt start from the following host, so
//! that a short bound cannot keep every attempt on the silent one.

use std::{
    future::Future,
    sync::atomic::{AtomicUsize, Ordering},
    task::Poll,
    time::Duration,
};

use tokio_postgres::{
    Client, Config, Connection, Error, Socket,
    config::{Host, LoadBalanceHosts},
    tls::{MakeTlsConnect, TlsConnect},
};

use crate::store::BoxFuture;

/// How long a host that neither connects nor fails has the field to itself before the
/// next one is tried beside it. A connection takes milliseconds within a region, a few
/// hundred across one with TLS; a start well within the store timeout (5 s by default)
/// and the pool's create timeout leaves the next host time to answer.
pub(super) const HEAD_START: Duration = Duration::from_millis(500);

/// The hosts of one configuration, each with a configuration of its own, and the one
/// to try first.
pub(super) struct Hosts {
    /// One configuration per host, in the order of the URL; the configuration itself
    /// when it names one host (or none: tokio-postgres reports that).
    each: Vec<Config>,
    random_start: bool,
    /// The host that gave the last connection.
    preferred: AtomicUsize,
}

impl Hosts {
    pub(super) fn new(config: &Config) -> Self {
        let n = config.get_hosts().len().max(config.get_hostaddrs().len());
        let each = if n <= 1 {
            vec![config.clone()]
        } else {
            (0..n).map(|i| one_host(config, i)).collect()
        };
        Self {
            each,
            random_start: config.get_load_balance_hosts() == LoadBalanceHosts::Random,
            preferred: AtomicUsize::new(0),
        }
    }

    /// A connection to the first host to give one, starting from the preferred one.
    pub(super) async fn connect<T>(
        &self,
        tls: T,
    ) -> Result<(Client, Connection<Socket, T::Stream>), Error>
    where
        T: MakeTlsConnect<Socket> + Clone,
    {
        let n = self.each.len();
        if n == 1 {
            return self.each[0].connect(tls).await;
        }
        let first = if self.random_start {
            usize::try_from(crate::random::u64() % n as u64).unwrap_or(0)
        } else {
            self.preferred.load(Ordering::Relaxed) % n
        };
        let mut order = (1..n).map(|i| (first + i) % n);
        let attempt = |host: usize| {
            let (config, tls) = (&self.each[host], tls.clone());
            Box::pin(async move { (host, config.connect(tls).await) })
        };
        // Given up on before a host answered: the next attempt starts further on.
        let mut unanswered = Unanswered {
            preferred: &self.preferred,
            first,
            next: (first + 1) % n,
            ended: false,
        };
        let mut running = Vec::with_capacity(n);
        running.push(attempt(first));
        let mut next_start = std::pin::pin!(tokio::time::sleep(HEAD_START));
        let mut last_error = None;
        let connected = std::future::poll_fn(|cx| {
            loop {
                let mut i = 0;
                while i < running.len() {
                    match running[i].as_mut().poll(cx) {
                        Poll::Pending => i += 1,
                        Poll::Ready((host, Ok(connected))) => {
                            return Poll::Ready(Ok((host, connected)));
                        }
                        Poll::Ready((_, Err(e))) => {
                            drop(running.swap_remove(i));
                            last_error = Some(e);
                            // A host that failed hands over at once.
                            next_start.as_mut().reset(tokio::time::Instant::now());
                        }
                    }
                }
                if order.len() > 0
                    && next_start.as_mut().poll(cx).is_ready()
                    && let Some(host) = order.next()
                {
                    running.push(attempt(host));
                    next_start
                        .as_mut()
                        .reset(tokio::time::Instant::now() + HEAD_START);
                    continue;
                }
                if running.is_empty() && order.len() == 0 {
                    return Poll::Ready(Err(last_error
                        .take()
                        .expect("every host was tried, and each failed")));
                }
                return Poll::Pending;
            }
        })
        .await;
        unanswered.ended = true;
        let (host, connected) = connected?;
        self.preferred.store(host, Ordering::Relaxed);
        Ok(connected)
    }
}

/// An attempt to connect, which moves the preferred host on from `first` to `next` if
/// it is dropped before it `ended` (unless another attempt moved it meanwhile).
struct Unanswered<'a> {
    preferred: &'a AtomicUsize,
    first: usize,
    next: usize,
    ended: bool,
}

impl Drop for Unanswered<'_> {
    fn drop(&mut self) {
        if !self.ended {
            let _ = self.preferred.compare_exchange(
                self.first,
                self.next,
                Ordering::Relaxed,
                Ordering::Relaxed,
            );
        }
    }
}

/// How the pools of `pool_for_url` connect: to `hosts`, with `tls`.
pub(super) struct PoolConnect<T> {
    pub(super) hosts: Hosts,
    pub(super) tls: T,
}

impl<T> deadpool_postgres::Connect for PoolConnect<T>
where
    T: MakeTlsConnect<Socket> + Clone + Send + Sync + 'static,
    T::Stream: Send + Sync + 'static,
    T::TlsConnect: Send + Sync,
    <T::TlsConnect as TlsConnect<Socket>>::Future: Send,
{
    fn connect(
        &self,
        _: &Config,
    ) -> BoxFuture<'_, Result<(Client, tokio::task::JoinHandle<()>), Error>> {
        Box::pin(async move {
            let (client, connection) = self.hosts.connect(self.tls.clone()).await?;
            // As deadpool-postgres runs the connections it makes.
            let task = tokio::spawn(async move {
                if let Err(e) = connection.await {
                    tracing::warn!(target: "deadpool.postgres", "Connection error: {e}");
                }
            });
            Ok((client, task))
        })
    }
}

/// The settings of `all` for its `i`-th host alone.
fn one_host(all: &Config, i: usize) -> Config {
    let mut one = Config::new();
    if let Some(user) = all.get_user() {
        one.user(user);
    }
    if let Some(password) = all.get_password() {
        one.password(password);
    }
    if let Some(dbname) = all.get_dbname() {
        one.dbname(dbname);
    }
    if let Some(options) = all.get_options() {
        one.options(options);
    }
    if let Some(name) = all.get_application_name() {
        one.application_name(name);
    }
    one.ssl_mode(all.get_ssl_mode())
        .ssl_negotiation(all.get_ssl_negotiation())
        .keepalives(all.get_keepalives())
        .keepalives_idle(all.get_keepalives_idle())
        .target_session_attrs(all.get_target_session_attrs())
        .channel_binding(all.get_channel_binding())
        .load_balance_hosts(all.get_load_balance_hosts());
    if let Some(timeout) = all.get_connect_timeout() {
        one.connect_timeout(*timeout);
    }
    if let Some(timeout) = all.get_tcp_user_timeout() {
        one.tcp_user_timeout(*timeout);
    }
    if let Some(interval) = all.get_keepalives_interval() {
        one.keepalives_interval(interval);
    }
    if let Some(retries) = all.get_keepalives_retries() {
        one.keepalives_retries(retries);
    }
    match all.get_hosts().get(i) {
        Some(Host::Tcp(host)) => {
            one.host(host);
        }
        #[cfg(unix)]
        Some(Host::Unix(path)) => {
            one.host_path(path);
        }
        None => {}
    }
    if let Some(addr) = all.get_hostaddrs().get(i) {
        one.hostaddr(*addr);
    }
    // One port for every host, or one each.
    if let Some(port) = all.get_ports().get(i).or(all.get_ports().first()) {
        one.port(*port);
    }
    one
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A port on this machine that accepts connections (the kernel does, into its
    /// backlog) and answers nothing, as a frozen primary does, for as long as the
    /// listener lives.
    fn silent() -> (std::net::TcpListener, u16) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = listener.local_addr().expect("its address").port();
        (listener, port)
    }

    #[tokio::test]
    async fn an_attempt_given_up_on_before_any_host_answered_moves_on_to_the_next_host() {
        let (_first, first) = silent();
        let (_second, second) = silent();
        let mut config = Config::new();
        config.host("127.0.0.1").port(first);
        config.host("127.0.0.1").port(second);
        config.user("postgres");
        let hosts = Hosts::new(&config);
        // Given up on before the next host has started (at `HEAD_START`).
        let attempt = tokio::time::timeout(HEAD_START / 5, hosts.connect(tokio_postgres::NoTls));
        assert!(attempt.await.is_err(), "a silent host answered");
        assert_eq!(hosts.preferred.load(Ordering::Relaxed), 1);
        // And from there to the one after it, around the list.
        let attempt = tokio::time::timeout(HEAD_START / 5, hosts.connect(tokio_postgres::NoTls));
        assert!(attempt.await.is_err(), "a silent host answered");
        assert_eq!(hosts.preferred.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn an_attempt_that_ended_or_was_overtaken_leaves_the_preferred_host_alone() {
        let preferred = AtomicUsize::new(2);
        let unanswered = |first, ended| Unanswered {
            preferred: &preferred,
            first,
            next: first + 1,
            ended,
        };
        drop(unanswered(2, true));
        assert_eq!(preferred.load(Ordering::Relaxed), 2, "ended");
        // Another attempt moved it meanwhile: this one, from host 1, leaves it.
        drop(unanswered(1, false));
        assert_eq!(preferred.load(Ordering::Relaxed), 2, "overtaken");
        drop(unanswered(2, false));
        assert_eq!(preferred.load(Ordering::Relaxed), 3, "given up on");
    }

    #[tokio::test]
    async fn when_every_host_fails_the_last_error_is_returned() {
        let sockets: Vec<_> = (0..2)
            .map(|_| {
                let socket = tokio::net::TcpSocket::new_v4().expect("a TCP socket");
                socket
                    .bind(([127, 0, 0, 1], 0).into())
                    .expect("bind 127.0.0.1:0");
                socket
            })
            .collect();
        let mut config = Config::new();
        for socket in &sockets {
            config
                .host("127.0.0.1")
                .port(socket.local_addr().expect("its address").port());
        }
        config.user("postgres");
        let hosts = Hosts::new(&config);
        let e = hosts
            .connect(tokio_postgres::NoTls)
            .await
            .err()
            .expect("no host to connect to");
        assert!(e.code().is_none(), "{e}");
        assert_eq!(hosts.preferred.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn each_host_keeps_every_other_setting_of_the_url() {
        let settings = "dbname=db user=u password=pw options='-c x=1' application_name=app \
            sslmode=disable connect_timeout=3 tcp_user_timeout=4 keepalives=1 \
            keepalives_idle=7 keepalives_interval=8 keepalives_retries=9 \
            target_session_attrs=read-write channel_binding=disable";
        let all: Config = format!("host=h1,h2,/run/pg port=5442,5443,5444 {settings}")
            .parse()
            .expect("a configuration");
        let hosts = Hosts::new(&all);
        assert_eq!(hosts.each.len(), 3);
        for (i, (host, port)) in [("h1", 5442), ("h2", 5443), ("/run/pg", 5444)]
            .into_iter()
            .enumerate()
        {
            let alone: Config = format!("host={host} port={port} {settings}")
                .parse()
                .expect("a configuration");
            assert!(hosts.each[i] == alone, "host {i} differs from {host} alone");
        }

        // One port for all, and addresses beside the names.
        let all: Config = "host=a,b hostaddr=10.0.0.1,10.0.0.2 port=6000 user=u"
            .parse()
            .expect("a configuration");
        let hosts = Hosts::new(&all);
        let alone: Config = "host=b hostaddr=10.0.0.2 port=6000 user=u"
            .parse()
            .expect("a configuration");
        assert!(hosts.each[1] == alone);

        // A single host is left as it is.
        let one: Config = "postgres://u@h/db?connect_timeout=2"
            .parse()
            .expect("a URL");
        assert!(Hosts::new(&one).each == [one]);
    }
}
