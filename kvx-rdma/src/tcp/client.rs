//! The consumer's TCP transport: pooled connections, pipelined reads straight into the op's
//! buffers, a hard stop at the deadline (the connection is dropped, never reused half-read).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvx_core::BlockError;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::time::{timeout, timeout_at};

use crate::descriptor::{RemoteDescriptor, TransportKind};
use crate::error::RdmaError;
use crate::transport::{BoxFuture, CancelToken, ReadSlot, Transport};
use crate::wire::{self, PROTOCOL_VERSION, Reply, ReplyHead, Request};

/// Bytes read ahead of a reply head: the head and the first bytes of its payload in one
/// syscall (those few bytes copied twice); the rest of a payload bypasses the buffer.
const HEAD_BUFFER: usize = 4096;

/// Settings of a [`TcpTransport`].
#[derive(Debug, Clone)]
pub struct TcpClientConfig {
    /// This reader's id (its tensor-parallel rank, say); the producer counts distinct ids.
    pub reader: u32,
    /// Shared token to present (default none).
    pub token: Option<String>,
    /// Connecting and the handshake must finish within this (default 2 s; never past a deadline).
    pub connect_timeout: Duration,
    /// Heartbeats and done notifications must finish within this (default 2 s).
    pub control_timeout: Duration,
    /// Reads in flight on one connection: at least this many (default 8), and at least
    /// `window_bytes` worth.
    pub window: usize,
    /// Bytes of reads in flight on one connection, at least (default 32 MiB). Asking costs
    /// nothing but the requests (replies land in the op's own buffers); with less in flight
    /// than a loopback socket buffers (Linux grows it to tens of MiB), the producer runs out of
    /// reads to answer and waits for the next batch.
    pub window_bytes: u64,
    /// Idle connections kept per producer (default 16: the 8 a long prompt's load reads over
    /// in kvx-offload, twice). Each counts against the producer's `max_connections`.
    pub max_idle: usize,
}

impl Default for TcpClientConfig {
    fn default() -> Self {
        TcpClientConfig {
            reader: 0,
            token: None,
            connect_timeout: Duration::from_secs(2),
            control_timeout: Duration::from_secs(2),
            window: 8,
            window_bytes: 32 << 20,
            max_idle: 16,
        }
    }
}

/// Reads exported blocks over TCP.
#[derive(Debug)]
pub struct TcpTransport {
    cfg: TcpClientConfig,
    /// Idle connections, off any reactor: the thread that checks one out watches it.
    idle: Mutex<HashMap<SocketAddr, Vec<std::net::TcpStream>>>,
    next_tag: AtomicU64,
}

impl TcpTransport {
    /// A transport with `cfg`.
    pub fn new(cfg: TcpClientConfig) -> TcpTransport {
        TcpTransport {
            cfg,
            idle: Mutex::new(HashMap::new()),
            next_tag: AtomicU64::new(1),
        }
    }

    fn tags(&self, n: usize) -> u64 {
        self.next_tag.fetch_add(n as u64, Ordering::Relaxed)
    }

    /// Connect and handshake.
    pub(crate) async fn connect(&self, addr: SocketAddr) -> Result<TcpStream, RdmaError> {
        let io = |what, source| RdmaError::Io { what, addr, source };
        let fut = async {
            let mut s = TcpStream::connect(addr)
                .await
                .map_err(|e| io("connecting to", e))?;
            s.set_nodelay(true).map_err(|e| io("configuring", e))?;
            let hello = Request::Hello {
                version: PROTOCOL_VERSION,
                reader: self.cfg.reader,
                token: self.cfg.token.clone().unwrap_or_default().into_bytes(),
            };
            s.write_all(&hello.encode())
                .await
                .map_err(|e| io("sending hello to", e))?;
            match wire::read_reply_head(&mut s, 0).await {
                Ok(ReplyHead::Control(Reply::Welcome { version, .. }))
                    if version == PROTOCOL_VERSION =>
                {
                    Ok(s)
                }
                Ok(ReplyHead::Control(Reply::Error { code, message, .. })) => {
                    Err(RdmaError::Remote {
                        addr,
                        code,
                        message,
                    })
                }
                Ok(other) => Err(RdmaError::Protocol {
                    addr,
                    what: format!("unexpected handshake reply {other:?}"),
                }),
                Err(what) => Err(RdmaError::Protocol { addr, what }),
            }
        };
        timeout(self.cfg.connect_timeout, fut)
            .await
            .map_err(|_| RdmaError::TimedOut {
                what: "connecting",
                addr,
            })?
    }

    /// A pooled connection to `addr` that is still open, or a new one; watched by the
    /// calling thread's runtime.
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))]
    pub(crate) async fn checkout(&self, addr: SocketAddr) -> Result<TcpStream, RdmaError> {
        match self.pooled(addr) {
            Some(s) => Ok(s),
            None => self.connect(addr).await,
        }
    }

    /// A pooled connection to `addr` that is still open, watched by the calling thread's
    /// runtime; `None` when the pool has none.
    fn pooled(&self, addr: SocketAddr) -> Option<TcpStream> {
        loop {
            let s = kvx_core::lock(&self.idle).get_mut(&addr)?.pop()?;
            // Closed by the producer while idle (its idle timeout, a restart): dropped.
            if still_open(&s) {
                if let Ok(s) = TcpStream::from_std(s) {
                    return Some(s);
                }
            }
        }
    }

    /// A connection to `addr` on which `request` went out and the first byte of its answer
    /// came back. The pool is tried first; a pooled connection the producer closed before
    /// answering (its idle timeout landing between the pool's check and the write) gives
    /// way to one new connection. Reads sent again are harmless (each answer lands in its
    /// slot once, on the connection that answers it); a heartbeat or done the producer did
    /// handle before the close is refused the second time, and the caller sees that error.
    async fn send_first(
        &self,
        addr: SocketAddr,
        request: &[u8],
    ) -> Result<BufReader<TcpStream>, RdmaError> {
        if let Some(s) = self.pooled(addr) {
            if let Ok(s) = answered(addr, s, request).await {
                return Ok(s);
            }
        }
        answered(addr, self.connect(addr).await?, request).await
    }

    /// Pool an in-sync connection (up to `max_idle` per producer), taken off this thread's
    /// reactor so that any thread may check it out.
    pub(crate) fn checkin(&self, addr: SocketAddr, s: TcpStream) {
        let Ok(s) = s.into_std() else { return };
        let mut idle = kvx_core::lock(&self.idle);
        let v = idle.entry(addr).or_default();
        if v.len() < self.cfg.max_idle {
            v.push(s);
        }
    }

    /// One side-channel round trip (a `Verbs` frame and its answer) on `s`.
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))]
    pub(crate) async fn side_call(
        &self,
        s: &mut TcpStream,
        addr: SocketAddr,
        body: Vec<u8>,
    ) -> Result<Vec<u8>, RdmaError> {
        let tag = self.tags(1);
        s.write_all(&Request::Verbs { tag, body }.encode())
            .await
            .map_err(|source| RdmaError::Io {
                what: "sending to",
                addr,
                source,
            })?;
        match wire::read_reply_head_limit(s, 0, 16 << 20)
            .await
            .map_err(|what| RdmaError::Protocol { addr, what })?
        {
            ReplyHead::Control(Reply::Verbs { tag: t, body }) if t == tag => Ok(body),
            ReplyHead::Control(Reply::Error { code, message, .. }) => Err(RdmaError::Remote {
                addr,
                code,
                message,
            }),
            other => Err(RdmaError::Protocol {
                addr,
                what: format!("unexpected side-channel reply {other:?}"),
            }),
        }
    }

    /// One control round trip (heartbeat or done).
    async fn control(&self, desc: &RemoteDescriptor, done: bool) -> Result<(), RdmaError> {
        let addr = desc.addr;
        let what = if done { "done" } else { "heartbeat" };
        let fut = async {
            let tag = self.tags(1);
            let req = if done {
                Request::Done {
                    tag,
                    request: desc.request.0,
                }
            } else {
                Request::Heartbeat {
                    tag,
                    request: desc.request.0,
                }
            };
            let mut s = self.send_first(addr, &req.encode()).await?;
            let reply = wire::read_reply_head(&mut s, 0)
                .await
                .map_err(|what| RdmaError::Protocol { addr, what })?;
            match reply {
                ReplyHead::Control(Reply::Ack { tag: t }) if t == tag => {
                    if let Some(s) = in_sync(s) {
                        self.checkin(addr, s);
                    }
                    Ok(())
                }
                ReplyHead::Control(Reply::Error {
                    tag: t,
                    code,
                    message,
                }) if t == tag || t == 0 => {
                    if t == tag && !code.is_fatal() {
                        if let Some(s) = in_sync(s) {
                            self.checkin(addr, s);
                        }
                    }
                    Err(RdmaError::Remote {
                        addr,
                        code,
                        message,
                    })
                }
                other => Err(RdmaError::Protocol {
                    addr,
                    what: format!("unexpected reply to {what}: {other:?}"),
                }),
            }
        };
        timeout(self.cfg.control_timeout, fut)
            .await
            .map_err(|_| RdmaError::TimedOut { what, addr })?
    }

    /// Pipelined reads of every slot on one connection. Fills `results[i]` as blocks arrive;
    /// leaves the rest `None` when it gives up. Returns the connection if it is still in sync.
    async fn read_all(
        &self,
        desc: &RemoteDescriptor,
        slots: &mut [ReadSlot<'_>],
        results: &mut [Option<Result<(), BlockError>>],
    ) -> Option<TcpStream> {
        let addr = desc.addr;
        let bytes = desc.block_bytes;
        // Slots whose buffer cannot hold a block are refused here, never requested.
        let mut wanted = Vec::with_capacity(slots.len());
        for (i, s) in slots.iter().enumerate() {
            if (s.buf.capacity() as u64) < bytes {
                results[i] = Some(Err(BlockError::Invalid(format!(
                    "buffer of {} bytes cannot hold a {bytes}-byte block",
                    s.buf.capacity()
                ))));
            } else {
                wanted.push(i);
            }
        }
        let n = wanted.len();
        if n == 0 {
            return None;
        }
        let base = self.tags(n);
        let read = |k: usize, index: u32| {
            Request::Read {
                tag: base + k as u64,
                request: desc.request.0,
                block: index,
                offset: 0,
                len: bytes,
            }
            .encode()
        };
        let window = self
            .cfg
            .window
            .max((self.cfg.window_bytes / bytes.max(1)) as usize)
            .clamp(1, 1024);
        let mut sent = 0;
        let mut batch = Vec::new();
        while sent < n.min(window) {
            batch.extend(read(sent, slots[wanted[sent]].index));
            sent += 1;
        }
        // Reply heads come through a small buffer (one syscall each, with the payload's first
        // bytes); payloads are read straight into the slots, past the buffer.
        let mut s = match self.send_first(addr, &batch).await {
            Ok(s) => s,
            Err(e) => {
                fail_rest(results, 0, BlockError::Io(e.to_string()));
                return None;
            }
        };
        for (k, &i) in wanted.iter().enumerate() {
            let tag = base + k as u64;
            let head = match wire::read_reply_head(&mut s, bytes).await {
                Ok(h) => h,
                Err(e) => {
                    fail_rest(results, 0, BlockError::Io(format!("{addr}: {e}")));
                    return None;
                }
            };
            match head {
                ReplyHead::Data { tag: t, len } if t == tag && len == bytes => {
                    let buf = &mut *slots[i].buf;
                    let len = len as usize;
                    buf.set_len(len);
                    if let Err(e) = s.read_exact(&mut buf.as_mut_full()[..len]).await {
                        buf.set_len(0);
                        fail_rest(
                            results,
                            0,
                            BlockError::Io(format!("reading from {addr}: {e}")),
                        );
                        return None;
                    }
                    results[i] = Some(Ok(()));
                }
                ReplyHead::Control(Reply::Error {
                    tag: t,
                    code,
                    message,
                }) if t == tag || t == 0 => {
                    let err = BlockError::Remote(format!("{}: {code:?}: {message}", desc.request));
                    if t == 0 || code.is_fatal() {
                        fail_rest(results, 0, err);
                        return None;
                    }
                    results[i] = Some(Err(err));
                }
                other => {
                    let what = format!(
                        "{addr} broke the protocol: expected the reply to tag {tag}, got {other:?}"
                    );
                    fail_rest(results, 0, BlockError::Io(what));
                    return None;
                }
            }
            // Refill the window in batches, once half of it has been answered.
            let outstanding = sent - (k + 1);
            if sent < n && outstanding <= window / 2 {
                let mut batch = Vec::new();
                while sent < n && sent - (k + 1) < window {
                    batch.extend(read(sent, slots[wanted[sent]].index));
                    sent += 1;
                }
                if let Err(e) = s.write_all(&batch).await {
                    fail_rest(
                        results,
                        0,
                        BlockError::Io(format!("sending reads to {addr}: {e}")),
                    );
                    return None;
                }
            }
        }
        in_sync(s)
    }
}

/// Send `request` on `s` and wait for the first byte of the answer (left in the buffer).
async fn answered(
    addr: SocketAddr,
    s: TcpStream,
    request: &[u8],
) -> Result<BufReader<TcpStream>, RdmaError> {
    let io = |what, source| RdmaError::Io { what, addr, source };
    let mut s = BufReader::with_capacity(HEAD_BUFFER, s);
    s.write_all(request)
        .await
        .map_err(|e| io("sending to", e))?;
    match s.fill_buf().await {
        Ok([]) => Err(io(
            "reading from",
            std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "the connection closed before an answer",
            ),
        )),
        Ok(_) => Ok(s),
        Err(e) => Err(io("reading from", e)),
    }
}

/// The connection under `s` once every reply on it was read whole: the buffer is empty unless
/// the producer sent more than was asked for, and such a connection is out of sync and not
/// pooled (`None`).
fn in_sync(s: BufReader<TcpStream>) -> Option<TcpStream> {
    s.buffer().is_empty().then(|| s.into_inner())
}

/// Whether an idle, in-sync (non-blocking) connection is still open: nothing to read on it
/// yet. The end of the stream (the producer closed it) or stray bytes mean it cannot be used.
fn still_open(s: &std::net::TcpStream) -> bool {
    matches!(s.peek(&mut [0u8; 1]), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
}

fn fail_rest(results: &mut [Option<Result<(), BlockError>>], from: usize, err: BlockError) {
    for r in results[from..].iter_mut().filter(|r| r.is_none()) {
        *r = Some(Err(err.clone()));
    }
}

impl Transport for TcpTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Tcp
    }

    fn read<'a, 'b: 'a>(
        &'a self,
        desc: &'a RemoteDescriptor,
        slots: &'a mut [ReadSlot<'b>],
        deadline: Instant,
        cancel: &'a CancelToken,
    ) -> BoxFuture<'a, Vec<Result<(), BlockError>>> {
        Box::pin(async move {
            let mut results: Vec<Option<Result<(), BlockError>>> = vec![None; slots.len()];
            let stop = {
                let work = self.read_all(desc, slots, &mut results);
                let until = tokio::time::Instant::from_std(deadline);
                tokio::select! {
                    conn = timeout_at(until, work) => match conn {
                        Ok(Some(conn)) => { self.checkin(desc.addr, conn); None }
                        Ok(None) => None,
                        Err(_) => Some(BlockError::TimedOut),
                    },
                    _ = cancel.cancelled() => Some(BlockError::Cancelled),
                }
                // `work` is dropped here: its connection closes and no byte lands in a buffer
                // after this point.
            };
            let stop = stop.unwrap_or_else(|| BlockError::Io("read abandoned".into()));
            results
                .into_iter()
                .map(|r| r.unwrap_or_else(|| Err(stop.clone())))
                .collect()
        })
    }

    fn heartbeat<'a>(&'a self, desc: &'a RemoteDescriptor) -> BoxFuture<'a, Result<(), RdmaError>> {
        Box::pin(self.control(desc, false))
    }

    fn done<'a>(&'a self, desc: &'a RemoteDescriptor) -> BoxFuture<'a, Result<(), RdmaError>> {
        Box::pin(self.control(desc, true))
    }
}
