//! The TLS of the connections the store makes itself, outside its pool: the `LISTEN`
//! connection, and the cancel requests for statements given up on. Plain TCP unless
//! the store is given a connector (`PostgresStore::with_tls`).

use std::{
    sync::Arc,
    task::{Context, Poll},
};

use tokio::io::{AsyncRead, AsyncWrite};
use tokio_postgres::{
    AsyncMessage, CancelToken, Client, Connection, Error, NoTls, Socket,
    tls::{MakeTlsConnect, TlsConnect},
};

use super::hosts::Hosts;
use crate::store::BoxFuture;

/// How the store's own connections are made: without TLS, or with a connector.
#[derive(Clone, Default)]
pub(super) struct Connector(Option<Arc<dyn Connect>>);

/// A connection's messages, whatever stream it runs over: what the listener reads.
pub(super) trait Messages: Send {
    fn poll_message(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<AsyncMessage, Error>>>;
}

impl<S, T> Messages for Connection<S, T>
where
    S: AsyncRead + AsyncWrite + Unpin + Send,
    T: AsyncRead + AsyncWrite + Unpin + Send,
{
    fn poll_message(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<AsyncMessage, Error>>> {
        Connection::poll_message(self, cx)
    }
}

type Connected = (Client, Box<dyn Messages>);

trait Connect: Send + Sync {
    fn connect(&self, hosts: Arc<Hosts>) -> BoxFuture<'static, Result<Connected, Error>>;
    fn cancel(&self, token: CancelToken) -> BoxFuture<'static, Result<(), Error>>;
}

/// A connector, its type erased.
struct With<T>(T);

impl<T> Connect for With<T>
where
    T: MakeTlsConnect<Socket> + Clone + Send + Sync + 'static,
    T::Stream: Send + Sync + 'static,
    T::TlsConnect: Send + Sync,
    <T::TlsConnect as TlsConnect<Socket>>::Future: Send,
{
    fn connect(&self, hosts: Arc<Hosts>) -> BoxFuture<'static, Result<Connected, Error>> {
        let tls = self.0.clone();
        Box::pin(async move {
            let (client, connection) = hosts.connect(tls).await?;
            Ok((client, Box::new(connection) as Box<dyn Messages>))
        })
    }

    fn cancel(&self, token: CancelToken) -> BoxFuture<'static, Result<(), Error>> {
        let tls = self.0.clone();
        Box::pin(async move { token.cancel_query(tls).await })
    }
}

impl Connector {
    /// Connections made with `tls`.
    pub(super) fn with<T>(tls: T) -> Self
    where
        T: MakeTlsConnect<Socket> + Clone + Send + Sync + 'static,
        T::Stream: Send + Sync + 'static,
        T::TlsConnect: Send + Sync,
        <T::TlsConnect as TlsConnect<Socket>>::Future: Send,
    {
        Self(Some(Arc::new(With(tls))))
    }

    /// Opens a connection to one of `hosts` (see `Hosts::connect`).
    pub(super) async fn connect(&self, hosts: &Arc<Hosts>) -> Result<Connected, Error> {
        match &self.0 {
            Some(tls) => tls.connect(hosts.clone()).await,
            None => {
                let (client, connection) = hosts.connect(NoTls).await?;
                Ok((client, Box::new(connection)))
            }
        }
    }

    /// Asks the server to cancel what `token`'s connection is running.
    pub(super) async fn cancel(&self, token: CancelToken) -> Result<(), Error> {
        match &self.0 {
            Some(tls) => tls.cancel(token).await,
            None => token.cancel_query(NoTls).await,
        }
    }
}
