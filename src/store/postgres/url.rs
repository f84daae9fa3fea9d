//! Pools from a URL: bounded waits, keepalives, and a multi-host URL that follows a
//! failover.

use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use tokio_postgres::{
    NoTls, Socket,
    tls::{MakeTlsConnect, TlsConnect},
};

use super::{config::ConfigError, hosts};

/// A pool for `url` with bounded waits: 5 s to connect, 5 s to wait for a connection.
/// Unless the URL sets them otherwise, its connections send TCP keepalives after a
/// minute of silence (every 10 s, failing after 3 unanswered), so that a NAT or a load
/// balancer keeps them, or they are found out, and fail when data they sent goes
/// unacknowledged for 30 s (`tcp_user_timeout`).
///
/// A URL may name a primary and its standbys, to follow a failover:
/// `postgres://app@db1,db2/payments?target_session_attrs=read-write`. A new connection
/// then starts with the host that gave the last one, and a host that has given none
/// within half a second is raced by the next, so that a primary gone without a word
/// (frozen, or cut off: connections accepted and never answered) does not keep the
/// pool from the promoted standby. (tokio-postgres alone tries the hosts in order, each
/// until it answers.)
///
/// # Errors
///
/// A [`ConfigError`] for a URL that does not parse, or a pool that cannot be built from
/// it. Nothing connects yet.
///
/// ```
/// let pool = tower_idempotency::store::pool_for_url("postgres://postgres@127.0.0.1/postgres", 8)?;
/// assert_eq!(pool.status().max_size, 8);
/// # Ok::<(), tower_idempotency::store::ConfigError>(())
/// ```
pub fn pool_for_url(url: &str, max_size: usize) -> Result<Pool, ConfigError> {
    pool_for_url_with_tls(url, max_size, NoTls)
}

/// [`pool_for_url`] with connections made with `tls` (ask for it in the URL:
/// `sslmode=require`). A store over it needs the connector too, for the connections
/// it makes outside the pool: [`PostgresStore::with_tls`](super::PostgresStore::with_tls), or build both with
/// [`PostgresStore::connect_with_tls`](super::PostgresStore::connect_with_tls).
///
/// # Errors
///
/// As [`pool_for_url`].
pub fn pool_for_url_with_tls<T>(url: &str, max_size: usize, tls: T) -> Result<Pool, ConfigError>
where
    T: MakeTlsConnect<Socket> + Clone + Send + Sync + 'static,
    T::Stream: Send + Sync + 'static,
    T::TlsConnect: Send + Sync,
    <T::TlsConnect as TlsConnect<Socket>>::Future: Send,
{
    let config = parse_url(url)?;
    let connect = hosts::PoolConnect {
        hosts: hosts::Hosts::new(&config),
        tls,
    };
    let manager = Manager::from_connect(
        config,
        connect,
        ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        },
    );
    Pool::builder(manager)
        .max_size(max_size)
        .runtime(Runtime::Tokio1)
        .wait_timeout(Some(Duration::from_secs(5)))
        .create_timeout(Some(Duration::from_secs(5)))
        .recycle_timeout(Some(Duration::from_secs(5)))
        .build()
        .map_err(|e| ConfigError(format!("cannot build the pool: {e}")))
}

/// TCP keepalive settings of `parse_url`, and the idle time tokio-postgres defaults to.
pub(super) const KEEPALIVES_IDLE: Duration = Duration::from_secs(60);
pub(super) const KEEPALIVES_INTERVAL: Duration = Duration::from_secs(10);
pub(super) const KEEPALIVES_RETRIES: u32 = 3;
pub(super) const DRIVER_KEEPALIVES_IDLE: Duration = Duration::from_secs(2 * 60 * 60);
/// How long sent data may go unacknowledged before the connection fails.
pub(super) const TCP_USER_TIMEOUT: Duration = Duration::from_secs(30);

/// Parses a database URL. Where the URL does not say otherwise: a 5 s connect timeout;
/// TCP keepalives after a minute of silence, every 10 s, the connection failing after
/// 3 unanswered ones (a NAT or a load balancer then keeps idle pooled connections, and
/// one that forgets them anyway is found out within two minutes, not two hours); and
/// a `tcp_user_timeout` of 30 s, so that a connection whose statements go
/// unacknowledged fails then, not after the kernel's retransmissions (about 15 min).
pub(super) fn parse_url(url: &str) -> Result<tokio_postgres::Config, ConfigError> {
    let mut config: tokio_postgres::Config = url
        .parse()
        .map_err(|e| ConfigError(format!("invalid database URL: {e}")))?;
    if config.get_connect_timeout().is_none() {
        config.connect_timeout(Duration::from_secs(5));
    }
    if config.get_keepalives() && config.get_keepalives_idle() == DRIVER_KEEPALIVES_IDLE {
        config.keepalives_idle(KEEPALIVES_IDLE);
    }
    if config.get_keepalives_interval().is_none() {
        config.keepalives_interval(KEEPALIVES_INTERVAL);
    }
    if config.get_keepalives_retries().is_none() {
        config.keepalives_retries(KEEPALIVES_RETRIES);
    }
    if config.get_tcp_user_timeout().is_none() {
        config.tcp_user_timeout(TCP_USER_TIMEOUT);
    }
    Ok(config)
}
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parsed_urls_notice_dead_connections_unless_they_say_otherwise() {
        let config = parse_url("postgres://u@h/db").expect("a URL");
        assert!(config.get_keepalives());
        assert_eq!(config.get_keepalives_idle(), Duration::from_secs(60));
        assert_eq!(
            config.get_keepalives_interval(),
            Some(Duration::from_secs(10))
        );
        assert_eq!(config.get_keepalives_retries(), Some(3));
        assert_eq!(
            config.get_tcp_user_timeout(),
            Some(&Duration::from_secs(30))
        );
        assert_eq!(config.get_connect_timeout(), Some(&Duration::from_secs(5)));

        let own = parse_url(
            "postgres://u@h/db?keepalives_idle=300&keepalives_interval=5&keepalives_retries=9&tcp_user_timeout=7&connect_timeout=2",
        )
        .expect("a URL");
        assert_eq!(own.get_keepalives_idle(), Duration::from_secs(300));
        assert_eq!(own.get_keepalives_interval(), Some(Duration::from_secs(5)));
        assert_eq!(own.get_keepalives_retries(), Some(9));
        assert_eq!(own.get_tcp_user_timeout(), Some(&Duration::from_secs(7)));
        assert_eq!(own.get_connect_timeout(), Some(&Duration::from_secs(2)));
    }
}
