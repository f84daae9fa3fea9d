//! A wrk-style HTTP/1.1 load client: one keep-alive connection per worker, each request
//! written with one `write`, each response read into a reused buffer and parsed with
//! `httparse`. It runs in the worker's own task: no pool to check a connection out of,
//! no connection task to hand the request to.
//!
//! The load generator shares the machine's cores with the app and the database, so its
//! own cost per request counts against every HTTP row (and never against the floors,
//! which have no HTTP). This client keeps that cost low, and the same for every row.

use std::{io::Write as _, net::SocketAddr};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
    sync::Mutex,
};

/// A response: its status, whether it was a replay, and the body of a 5xx.
pub(crate) struct Reply {
    pub(crate) status: u16,
    pub(crate) replayed: bool,
    pub(crate) body: Vec<u8>,
}

struct Conn {
    stream: TcpStream,
    req: Vec<u8>,
    buf: Vec<u8>,
}

/// One connection per worker, opened on first use and again after an error.
pub(crate) struct Clients {
    addr: SocketAddr,
    slots: Vec<Mutex<Option<Conn>>>,
    /// Each worker's `Cookie` header line, if it has one (empty if not).
    cookies: Vec<String>,
}

impl Clients {
    pub(crate) fn new(addr: SocketAddr, workers: usize) -> Self {
        Self::with_cookies(addr, vec![String::new(); workers])
    }

    /// A client per worker whose requests carry that worker's cookie (`name=value`),
    /// as a browser's would once logged in; an empty one sends none.
    pub(crate) fn with_cookies(addr: SocketAddr, cookies: Vec<String>) -> Self {
        Self {
            addr,
            slots: (0..cookies.len()).map(|_| Mutex::new(None)).collect(),
            cookies: cookies
                .into_iter()
                .map(|c| {
                    if c.is_empty() {
                        c
                    } else {
                        format!("cookie: {c}\r\n")
                    }
                })
                .collect(),
        }
    }

    /// `POST /payments` with `body` (JSON) and the key, if any, on worker `w`'s connection.
    pub(crate) async fn post(
        &self,
        w: usize,
        key: Option<&str>,
        body: &[u8],
    ) -> Result<Reply, String> {
        // Each worker only ever locks its own slot: the lock is never contended.
        let mut slot = self.slots[w].lock().await;
        if slot.is_none() {
            let stream = TcpStream::connect(self.addr)
                .await
                .map_err(|e| e.to_string())?;
            stream.set_nodelay(true).map_err(|e| e.to_string())?;
            *slot = Some(Conn {
                stream,
                req: Vec::with_capacity(512),
                buf: Vec::with_capacity(4096),
            });
        }
        let Some(conn) = slot.as_mut() else {
            unreachable!("opened above");
        };
        let reply = conn.post(self.addr, key, &self.cookies[w], body).await;
        if reply.is_err() {
            // Start afresh: the connection's state is unknown.
            *slot = None;
        }
        reply
    }
}

impl Conn {
    /// Reads what has arrived onto `buf`; `closed` is the error if the server hung up.
    async fn read_more(&mut self, closed: &str) -> Result<(), String> {
        match self.stream.read_buf(&mut self.buf).await {
            Ok(0) => Err(closed.to_owned()),
            Ok(_) => Ok(()),
            Err(e) => Err(e.to_string()),
        }
    }

    async fn post(
        &mut self,
        host: SocketAddr,
        key: Option<&str>,
        cookie: &str,
        body: &[u8],
    ) -> Result<Reply, String> {
        self.req.clear();
        let _ = write!(
            self.req,
            "POST /payments HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n",
            body.len()
        );
        if let Some(key) = key {
            let _ = write!(self.req, "idempotency-key: {key}\r\n");
        }
        self.req.extend_from_slice(cookie.as_bytes());
        self.req.extend_from_slice(b"\r\n");
        self.req.extend_from_slice(body);
        self.stream
            .write_all(&self.req)
            .await
            .map_err(|e| e.to_string())?;

        self.buf.clear();
        loop {
            self.read_more("the server closed the connection").await?;
            let mut headers = [httparse::EMPTY_HEADER; 32];
            let mut res = httparse::Response::new(&mut headers);
            let head = match res.parse(&self.buf).map_err(|e| e.to_string())? {
                httparse::Status::Complete(n) => n,
                httparse::Status::Partial => continue,
            };
            let status = res.code.ok_or("no status")?;
            let mut len = None;
            let mut replayed = false;
            for h in res.headers.iter() {
                if h.name.eq_ignore_ascii_case("content-length") {
                    len = std::str::from_utf8(h.value)
                        .ok()
                        .and_then(|v| v.trim().parse::<usize>().ok());
                } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
                    return Err("a chunked response: this client reads Content-Length only".into());
                } else if h.name.eq_ignore_ascii_case("idempotent-replayed") {
                    replayed = true;
                }
            }
            let len = len.ok_or("a response without Content-Length")?;
            while self.buf.len() < head + len {
                self.read_more("the server closed the connection mid-body")
                    .await?;
            }
            if self.buf.len() > head + len {
                return Err("bytes after the response: the server answered twice".into());
            }
            // The body is only ever read to report an error.
            let body = if status >= 500 {
                self.buf[head..].to_vec()
            } else {
                Vec::new()
            };
            return Ok(Reply {
                status,
                replayed,
                body,
            });
        }
    }
}
