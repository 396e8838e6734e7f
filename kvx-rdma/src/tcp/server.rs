//! The producer's TCP server: one task per connection, every read checked against the export
//! table and its lease, timeouts on every read and write so one slow or hostile peer only ever
//! stalls its own connection.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvx_core::RequestId;

use tokio::io::{AsyncBufRead, AsyncRead, AsyncWrite, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio::time::timeout;
use tracing::{debug, warn};

use crate::descriptor::{RemoteDescriptor, TransportKind};
use crate::error::RdmaError;
use crate::exporter::Exporter;
use crate::exports::Refusal;
use crate::shards::{ShardThreads, Shards};
use crate::tcp::reads::{Read, take_buffered};
use crate::tcp::replies::serve_reads;
use crate::tcp::send::{Frame, Stop, send_until};
use crate::wire::{self, ErrorCode, FrameError, MAX_HELLO, PROTOCOL_VERSION, Reply, Request};

/// Settings of a [`TcpServer`].
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Where to listen (default `127.0.0.1:0`: loopback, any free port).
    pub listen: SocketAddr,
    /// Shared token every client must present (default none).
    pub token: Option<String>,
    /// Largest frame a client may send (default 4 KiB; reads are small requests).
    pub max_frame: u32,
    /// Largest read served in one reply (default 64 MiB).
    pub max_read: u64,
    /// A client must complete its `Hello` within this (default 5 s).
    pub handshake_timeout: Duration,
    /// A frame whose first byte arrived must complete within this (default 5 s).
    pub frame_timeout: Duration,
    /// Every byte of each reply must be written within this, or the reply is cut and the
    /// connection reset (default 5 s). A data reply is also cut when its request's lease ends,
    /// so a slow reader never holds the engine's blocks past the lease. Replies to reads sent
    /// together go out together, each timed from when the one before it was written.
    pub write_timeout: Duration,
    /// A connection with no frame for this long is closed (default 10 min).
    pub idle_timeout: Duration,
    /// Connections served at once; more are refused with `Busy` (default 1024).
    pub max_connections: usize,
    /// Serving threads (default: one per core, at most 8); each connection is served by the
    /// least busy one, from its handshake to its end. On 2 cores, prefill → decode through the
    /// connector read 3.5-4.6 GiB/s with 8 against 3.2-3.8 with 2, but the 8 busy threads
    /// sometimes kept an engine thread of the same machine from its core for ~5 ms.
    pub threads: usize,
    /// Fault injection for tests and demos: wait this long before each data reply (default 0).
    pub pace: Duration,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            token: None,
            max_frame: 4096,
            max_read: 64 << 20,
            handshake_timeout: Duration::from_secs(5),
            frame_timeout: Duration::from_secs(5),
            write_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(600),
            max_connections: 1024,
            threads: crate::shards::default_count(),
            pace: Duration::ZERO,
        }
    }
}

/// Handles side-channel frames of another transport (verbs) on this server's connections.
pub(crate) trait SideChannel: Send + Sync {
    /// Answer one side-channel message of connection `conn` from reader `reader`.
    fn handle(&self, conn: u64, reader: u32, body: &[u8]) -> Result<Vec<u8>, Refusal>;
    /// Connection `conn` closed: free what it set up.
    fn closed(&self, conn: u64);
}

/// What every connection's task shares: the exports, the settings, the side channel.
pub(super) struct Ctx {
    pub(super) exporter: Exporter,
    pub(super) cfg: ServerConfig,
    side: Option<Arc<dyn SideChannel>>,
    next_conn: std::sync::atomic::AtomicU64,
}

/// The producer's TCP server. Serves until dropped; dropping it waits (at most 1 s, and not
/// on one of its own threads) until no thread of the server can still be copying from the
/// memory it serves, so that memory may be freed next.
pub struct TcpServer {
    addr: SocketAddr,
    /// Held for its drop, which stops the threads.
    _threads: ShardThreads,
}

impl TcpServer {
    /// Listen on `cfg.listen` and serve `exporter`'s requests.
    pub fn start(exporter: Exporter, cfg: ServerConfig) -> Result<TcpServer, RdmaError> {
        TcpServer::start_with(exporter, cfg, None)
    }

    pub(crate) fn start_with(
        exporter: Exporter,
        mut cfg: ServerConfig,
        side: Option<Arc<dyn SideChannel>>,
    ) -> Result<TcpServer, RdmaError> {
        // A data frame's length prefix is a u32 covering the type byte and the tag too.
        cfg.max_read = cfg.max_read.min(u64::from(u32::MAX) - 9);
        let (shards, threads) = Shards::start("kvx-rdma-server", cfg.threads)
            .map_err(|e| RdmaError::Runtime(format!("cannot start the server threads: {e}")))?;
        let listen = cfg.listen;
        let std_listener = std::net::TcpListener::bind(listen).map_err(|source| RdmaError::Io {
            what: "listening on",
            addr: listen,
            source,
        })?;
        let io = |source| RdmaError::Io {
            what: "listening on",
            addr: listen,
            source,
        };
        std_listener.set_nonblocking(true).map_err(io)?;
        let addr = std_listener.local_addr().map_err(io)?;
        let ctx = Arc::new(Ctx {
            exporter,
            cfg,
            side,
            next_conn: std::sync::atomic::AtomicU64::new(1),
        });
        // The listener is watched by the first thread; whether that worked is known before
        // `start` returns, so a server that cannot accept is never handed out.
        let (watching, watched) = std::sync::mpsc::channel();
        shards.spawn_background(reaper(ctx.exporter.clone()));
        shards.spawn_background({
            let shards = shards.clone();
            async move {
                match TcpListener::from_std(std_listener) {
                    Ok(listener) => {
                        let _ = watching.send(Ok(()));
                        accept_loop(listener, shards, ctx).await;
                    }
                    Err(e) => {
                        let _ = watching.send(Err(e));
                    }
                }
            }
        });
        match watched.recv_timeout(Duration::from_secs(5)) {
            Ok(Ok(())) => Ok(TcpServer {
                addr,
                _threads: threads,
            }),
            Ok(Err(e)) => Err(io(e)),
            Err(_) => Err(RdmaError::Runtime(
                "the server's first thread did not start watching the listener within 5 s".into(),
            )),
        }
    }

    /// The address the server listens on (with the real port when `listen` asked for port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The descriptor of an exported `request`, pointing at this server.
    pub fn descriptor(
        &self,
        exporter: &Exporter,
        request: RequestId,
    ) -> Result<RemoteDescriptor, RdmaError> {
        exporter.descriptor(request, self.addr, TransportKind::Tcp)
    }
}

/// Expire leases at their deadline even when nobody polls, so releases are reported on time.
/// A lease that starts or ends wakes it to recompute the next expiry.
async fn reaper(exporter: Exporter) {
    let mut events = exporter.lease_events();
    loop {
        let now = Instant::now();
        let next = exporter
            .next_expiry()
            .unwrap_or(now + Duration::from_millis(100))
            .min(now + Duration::from_millis(100));
        tokio::select! {
            _ = tokio::time::sleep_until(tokio::time::Instant::from_std(next)) => {}
            _ = events.changed() => {}
        }
        exporter.tick(Instant::now());
    }
}

/// Accept connections and hand each to the least busy serving thread, which serves it to its
/// end.
async fn accept_loop(listener: TcpListener, shards: Shards, ctx: Arc<Ctx>) {
    let slots = Arc::new(Semaphore::new(ctx.cfg.max_connections.max(1)));
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(x) => x,
            Err(e) => {
                warn!(error = %e, "kvx-rdma server: accept failed");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let ctx = ctx.clone();
        match slots.clone().try_acquire_owned() {
            Ok(permit) => {
                // Moved to its serving thread's reactor: only that thread is woken for it.
                let stream = match stream.into_std() {
                    Ok(s) => s,
                    Err(e) => {
                        warn!(error = %e, %peer, "kvx-rdma server: cannot hand a connection over");
                        continue;
                    }
                };
                shards.spawn(async move {
                    match TcpStream::from_std(stream) {
                        Ok(stream) => serve(stream, peer, &ctx).await,
                        Err(e) => {
                            warn!(error = %e, %peer, "kvx-rdma server: cannot serve a connection")
                        }
                    }
                    drop(permit);
                });
            }
            Err(_) => {
                tokio::spawn(async move {
                    let mut stream = stream;
                    let msg = format!(
                        "server is at its limit of {} connections",
                        ctx.cfg.max_connections
                    );
                    let _ = send_error(&mut stream, &ctx.cfg, 0, ErrorCode::Busy, &msg).await;
                });
            }
        }
    }
}

/// Write a control frame; it must be fully written within the write timeout.
async fn send<W: AsyncWrite + Unpin>(
    stream: &mut W,
    cfg: &ServerConfig,
    bytes: &[u8],
) -> Result<(), Stop> {
    let until = Instant::now() + cfg.write_timeout;
    send_until(stream, &mut Frame::new(bytes, until), None).await
}

async fn send_error<W: AsyncWrite + Unpin>(
    stream: &mut W,
    cfg: &ServerConfig,
    tag: u64,
    code: ErrorCode,
    message: &str,
) -> Result<(), Stop> {
    let frame = Reply::Error {
        tag,
        code,
        message: message.to_string(),
    }
    .encode();
    send(stream, cfg, &frame).await
}

fn token_matches(expected: &Option<String>, got: &[u8]) -> bool {
    let want = expected.as_deref().unwrap_or("").as_bytes();
    // Length is not secret; compare the bytes without an early exit.
    want.len() == got.len() && want.iter().zip(got).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
}

/// Read and check the `Hello`; returns the reader id.
async fn handshake<R: AsyncRead + Unpin>(
    stream: &mut R,
    cfg: &ServerConfig,
) -> Result<u32, Refusal> {
    let body = match wire::read_body(stream, MAX_HELLO).await {
        Ok(b) => b,
        Err(FrameError::TooLarge(n)) => {
            return Err((
                ErrorCode::BadHandshake,
                format!("first frame announces {n} bytes; not a kvx-rdma hello (max {MAX_HELLO})"),
            ));
        }
        Err(FrameError::Empty) => {
            return Err((ErrorCode::BadHandshake, "empty first frame".into()));
        }
        Err(FrameError::Eof) | Err(FrameError::Io(_)) => {
            return Err((
                ErrorCode::BadHandshake,
                "connection closed in the handshake".into(),
            ));
        }
    };
    match Request::decode(&body) {
        Ok(Request::Hello {
            version,
            reader,
            token,
        }) => {
            if version != PROTOCOL_VERSION {
                return Err((
                    ErrorCode::VersionMismatch,
                    format!(
                        "client speaks protocol version {version}, this server speaks {PROTOCOL_VERSION}"
                    ),
                ));
            }
            if !token_matches(&cfg.token, &token) {
                return Err((
                    ErrorCode::BadToken,
                    if token.is_empty() {
                        "this server requires a token".into()
                    } else {
                        "wrong token".into()
                    },
                ));
            }
            Ok(reader)
        }
        Ok(_) => Err((
            ErrorCode::BadHandshake,
            "the first frame must be a hello".into(),
        )),
        Err(e) => Err((ErrorCode::BadHandshake, format!("bad hello: {e}"))),
    }
}

async fn serve(mut stream: TcpStream, peer: SocketAddr, ctx: &Ctx) {
    let conn = ctx
        .next_conn
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let _ = stream.set_nodelay(true);
    if serve_conn(&mut stream, peer, conn, ctx).await == Some(Stop::Cut) {
        // The reader must not wait for the rest of a frame that will never come.
        let _ = stream.set_zero_linger();
    }
    if let Some(side) = &ctx.side {
        side.closed(conn);
    }
}

/// Serve one connection until it ends; `Some(stop)` when a reply ended it.
async fn serve_conn(
    stream: &mut TcpStream,
    peer: SocketAddr,
    conn: u64,
    ctx: &Ctx,
) -> Option<Stop> {
    let cfg = &ctx.cfg;
    let (rd, mut wr) = stream.split();
    // Requests are small and pipelined: read them through a buffer, one syscall for many.
    let mut rd = BufReader::with_capacity(8192, rd);
    let stream = &mut wr;
    let reader = match timeout(cfg.handshake_timeout, handshake(&mut rd, cfg)).await {
        Ok(Ok(r)) => r,
        Ok(Err((code, msg))) => {
            debug!(%peer, ?code, %msg, "kvx-rdma server: handshake refused");
            let _ = send_error(stream, cfg, 0, code, &msg).await;
            return None;
        }
        Err(_) => {
            let msg = format!("no hello within {:?}", cfg.handshake_timeout);
            let _ = send_error(stream, cfg, 0, ErrorCode::BadHandshake, &msg).await;
            return None;
        }
    };
    let welcome = Reply::Welcome {
        version: PROTOCOL_VERSION,
        max_read: cfg.max_read,
    }
    .encode();
    if send(stream, cfg, &welcome).await.is_err() {
        return None;
    }
    loop {
        let len = match timeout(cfg.idle_timeout, wire::read_len(&mut rd, cfg.max_frame)).await {
            Err(_) => return None,
            Ok(Err(FrameError::Eof)) | Ok(Err(FrameError::Io(_))) => return None,
            Ok(Err(FrameError::TooLarge(n))) => {
                let msg = format!(
                    "frame of {n} bytes exceeds the maximum of {}",
                    cfg.max_frame
                );
                let _ = send_error(stream, cfg, 0, ErrorCode::FrameTooLarge, &msg).await;
                return None;
            }
            Ok(Err(FrameError::Empty)) => {
                let msg = "zero-length frame";
                let _ = send_error(stream, cfg, 0, ErrorCode::MalformedFrame, msg).await;
                return None;
            }
            Ok(Ok(len)) => len,
        };
        let mut body = Vec::new();
        let frame = wire::read_growing(&mut rd, &mut body, len as usize);
        match timeout(cfg.frame_timeout, frame).await {
            Ok(Ok(_)) => {}
            Ok(Err(_)) => return None,
            Err(_) => {
                let msg = format!(
                    "frame of {len} bytes not complete within {:?}",
                    cfg.frame_timeout
                );
                let _ = send_error(stream, cfg, 0, ErrorCode::MalformedFrame, &msg).await;
                return None;
            }
        }
        let req = match Request::decode(&body) {
            Ok(r) => r,
            Err(e) => {
                let _ = send_error(stream, cfg, 0, ErrorCode::MalformedFrame, &e).await;
                return None;
            }
        };
        let ok = match req {
            Request::Hello { .. } => {
                let _ = send_error(stream, cfg, 0, ErrorCode::MalformedFrame, "second hello").await;
                return None;
            }
            Request::Read { .. } => {
                let mut batch: Vec<Read> = Read::of(&req).into_iter().collect();
                // Fault injection paces each reply: no batches then.
                if cfg.pace.is_zero() {
                    let used = take_buffered(rd.buffer(), cfg.max_frame, &mut batch);
                    Pin::new(&mut rd).consume(used);
                }
                serve_reads(stream, ctx, &batch).await
            }
            Request::Heartbeat { tag, request } => {
                let r = ctx.exporter.heartbeat(RequestId(request));
                answer(stream, cfg, tag, r).await
            }
            Request::Done { tag, request } => {
                let r = ctx.exporter.reader_done(RequestId(request), reader);
                answer(stream, cfg, tag, r).await
            }
            Request::Verbs { tag, body } => match &ctx.side {
                Some(side) => match side.handle(conn, reader, &body) {
                    Ok(body) => send(stream, cfg, &Reply::Verbs { tag, body }.encode()).await,
                    Err((code, msg)) => send_error(stream, cfg, tag, code, &msg).await,
                },
                None => {
                    let msg = "this server has no verbs transport";
                    send_error(stream, cfg, tag, ErrorCode::Unsupported, msg).await
                }
            },
        };
        if let Err(stop) = ok {
            debug!(%peer, ?stop, "kvx-rdma server: a reply failed or missed its deadline; connection dropped");
            return Some(stop);
        }
    }
}

async fn answer<W: AsyncWrite + Unpin>(
    stream: &mut W,
    cfg: &ServerConfig,
    tag: u64,
    r: Result<(), Refusal>,
) -> Result<(), Stop> {
    match r {
        Ok(()) => send(stream, cfg, &Reply::Ack { tag }.encode()).await,
        Err((code, msg)) => send_error(stream, cfg, tag, code, &msg).await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_comparison() {
        assert!(token_matches(&None, b""));
        assert!(!token_matches(&None, b"x"));
        assert!(token_matches(&Some("abc".into()), b"abc"));
        assert!(!token_matches(&Some("abc".into()), b"abd"));
        assert!(!token_matches(&Some("abc".into()), b"ab"));
    }
}
