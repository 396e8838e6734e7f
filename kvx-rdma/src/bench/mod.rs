//! A producer and a consumer over loopback TCP in one process, and the raw socket copy they
//! are measured against. Shared by `kvx bench remote` and the criterion benchmark.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use kvx_core::{
    AlignedBuf, BackendId, BlockKey, Buf, BufferPool, DEFAULT_ALIGN, Direction, Driver,
    DriverBuilder, DriverConfig, EngineBlockId, KvLayout, MemoryKind, OpBlock, RequestId, TaskSpec,
};
use kvx_policy::LeaseConfig;

use crate::descriptor::RemoteDescriptor;
use crate::error::RdmaError;
use crate::exporter::Exporter;
use crate::importer::{Importer, ImporterConfig, ImporterHandle};
use crate::tcp::{ServerConfig, TcpServer};

/// Producer (engine arena, exporter, server) and consumer (importer in a driver) on loopback.
pub struct LoopbackRig {
    // Drop order: the consumer, then the server, then the memory it serves.
    driver: Driver,
    handle: ImporterHandle,
    rdma: BackendId,
    pool: BufferPool,
    desc: RemoteDescriptor,
    server: TcpServer,
    exporter: Exporter,
    arena: AlignedBuf,
    block_bytes: usize,
    staging: usize,
}

impl LoopbackRig {
    /// `blocks` blocks of `block_bytes` exported as one request; staging buffers for `depth`
    /// tasks of `task_blocks` blocks in flight at once.
    pub fn new(
        block_bytes: usize,
        blocks: u32,
        task_blocks: usize,
        depth: usize,
    ) -> Result<LoopbackRig, RdmaError> {
        let bad = |e: kvx_core::CoreError| RdmaError::BadLayout(e.to_string());
        let mut arena =
            AlignedBuf::new(block_bytes * blocks as usize, DEFAULT_ALIGN).map_err(bad)?;
        for (b, chunk) in arena.as_mut_slice().chunks_mut(block_bytes).enumerate() {
            chunk.fill((b % 251) as u8);
        }
        let layout = KvLayout::contiguous(
            arena.as_ptr() as usize,
            MemoryKind::Host,
            block_bytes,
            blocks,
        )
        .map_err(bad)?;
        // SAFETY: the arena is a field of the rig, dropped after the server and the exporter
        // (field order); nothing writes it after the fill above.
        let exporter = unsafe { Exporter::new(layout)? };
        let server = TcpServer::start(exporter.clone(), ServerConfig::default())?;
        let lease = LeaseConfig::with_ttl_ms(600_000);
        let blocks_list: Vec<_> = (0..blocks)
            .map(|b| (BlockKey::chain(None, &b.to_le_bytes()), EngineBlockId(b)))
            .collect();
        exporter.export(RequestId(1), &blocks_list, &lease)?;
        exporter.ready(RequestId(1))?;
        let desc = server.descriptor(&exporter, RequestId(1))?;
        let importer = Importer::new(ImporterConfig::default())?;
        let handle = importer.handle();
        handle.register(desc.clone())?;
        let mut b = DriverBuilder::new(DriverConfig::default());
        let rdma = b.backend(Box::new(importer));
        let driver = b.spawn().map_err(|e| RdmaError::Runtime(e.to_string()))?;
        let staging = task_blocks * depth.max(1);
        let pool = BufferPool::new(staging, block_bytes, DEFAULT_ALIGN).map_err(bad)?;
        Ok(LoopbackRig {
            driver,
            handle,
            rdma,
            pool,
            desc,
            server,
            exporter,
            arena,
            block_bytes,
            staging,
        })
    }

    /// Blocks exported.
    pub fn blocks(&self) -> usize {
        self.desc.blocks.len()
    }

    /// Read blocks `first..first+n` (wrapping) as one task; returns its latency.
    pub fn read_task(&self, first: usize, n: usize) -> Result<Duration, String> {
        let t = self.submit_task(first, n)?;
        self.wait_task(t)
    }

    /// Submit a task reading blocks `first..first+n` (wrapping); finish it with `wait_task`.
    pub fn submit_task(&self, first: usize, n: usize) -> Result<PendingTask, String> {
        let keys = &self.desc.blocks;
        let blocks = (0..n)
            .map(|i| {
                let buf = self.pool.take().ok_or("staging pool exhausted")?;
                Ok(OpBlock {
                    key: keys[(first + i) % keys.len()],
                    engine: None,
                    buf: Buf::Owned(buf),
                })
            })
            .collect::<Result<Vec<_>, String>>()?;
        let start = Instant::now();
        let deadline = start + Duration::from_secs(30);
        let task = self
            .driver
            .submit(TaskSpec {
                request: RequestId(2),
                dir: Direction::Load,
                route: vec![self.rdma],
                blocks,
                deadline,
                deferred: false,
            })
            .map_err(|e| e.to_string())?;
        Ok(PendingTask {
            task,
            start,
            deadline,
            first,
        })
    }

    /// Wait for a submitted task, check its bytes, and return its latency.
    pub fn wait_task(&self, t: PendingTask) -> Result<Duration, String> {
        let keys = &self.desc.blocks;
        let report = self
            .driver
            .wait_report(t.task, t.deadline + Duration::from_secs(1))
            .ok_or("no report")?;
        let took = t.start.elapsed();
        if !report.is_ok() {
            let err = report.blocks.iter().find_map(|b| b.result.clone().err());
            return Err(format!("task failed: {:?} {err:?}", report.state));
        }
        let want = ((t.first % keys.len()) % 251) as u8;
        let got = report.blocks[0].buf.as_ref().map(|b| b.as_slice()[0]);
        if got != Some(want) {
            return Err(format!("wrong bytes: {got:?}, expected {want}"));
        }
        Ok(took)
    }

    /// The exporter (for stats).
    pub fn exporter(&self) -> &Exporter {
        &self.exporter
    }

    /// The server's address.
    pub fn addr(&self) -> std::net::SocketAddr {
        self.server.local_addr()
    }
}

impl LoopbackRig {
    /// The physical path for the same bytes: `connections` plain loopback TCP connections at
    /// once (as many as kvx has load tasks in flight, each on its own connection), block `i`
    /// on connection `i % connections`; each sender writes its blocks straight from the engine
    /// memory, each receiver reads them into its share of as many destination buffers as the
    /// staging pool has, in turn. Every connection is warmed up by one untimed pass; the timed
    /// pass starts when every receiver finished its warm-up, and no sender writes a byte of it
    /// before then (each waits for its receiver's go byte). Returns the timed pass's duration.
    pub fn raw_tcp_copy(&self, connections: usize) -> std::io::Result<Duration> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let bs = self.block_bytes;
        let blocks = self.blocks();
        let n = connections.clamp(1, blocks.max(1));
        let dests_each = (self.staging / n).max(1);
        let ready = std::sync::Barrier::new(n + 1);
        std::thread::scope(|scope| {
            let mut senders = Vec::new();
            for _ in 0..n {
                let (listener, arena) = (&listener, &self.arena);
                senders.push(scope.spawn(move || -> std::io::Result<()> {
                    let mut s = accept_within(listener, RAW_COPY_STALL)?;
                    let mut which = [0u8; 4];
                    s.read_exact(&mut which)?;
                    let c = u32::from_le_bytes(which) as usize;
                    let mine = || arena.as_slice().chunks(bs).skip(c).step_by(n);
                    // Warm-up pass (untimed, like kvx's warm-up round), then the timed pass.
                    for block in mine() {
                        s.write_all(block)?;
                    }
                    s.read_exact(&mut [0u8])?;
                    for block in mine() {
                        s.write_all(block)?;
                    }
                    Ok(())
                }));
            }
            let mut receivers = Vec::new();
            for c in 0..n {
                let ready = &ready;
                receivers.push(scope.spawn(move || -> std::io::Result<()> {
                    // Touched before the clock starts, like the staging pool (allocated up front).
                    let mut dest: Vec<Vec<u8>> = (0..dests_each).map(|_| vec![1u8; bs]).collect();
                    let pass = |s: &mut TcpStream, dest: &mut [Vec<u8>]| -> std::io::Result<()> {
                        for (k, _) in (c..blocks).step_by(n).enumerate() {
                            s.read_exact(&mut dest[k % dests_each])?;
                        }
                        Ok(())
                    };
                    let warmed = TcpStream::connect(addr).and_then(|mut s| {
                        configure(&s)?;
                        s.write_all(&(c as u32).to_le_bytes())?;
                        pass(&mut s, &mut dest)?;
                        Ok(s)
                    });
                    // Every receiver reaches the start line, failed or not; a sender whose
                    // receiver failed gives up at its accept or read timeout.
                    ready.wait();
                    let mut s = warmed?;
                    s.write_all(&[1])?;
                    pass(&mut s, &mut dest)
                }));
            }
            ready.wait();
            let t0 = Instant::now();
            let mut first_error = None;
            for h in receivers.into_iter().chain(senders) {
                let r = h
                    .join()
                    .unwrap_or_else(|_| Err(std::io::Error::other("a copy thread panicked")));
                if let Err(e) = r {
                    first_error.get_or_insert(e);
                }
            }
            let took = t0.elapsed();
            first_error.map_or(Ok(took), Err)
        })
    }
}

/// How long a raw-copy thread waits for its peer before giving up with an error.
const RAW_COPY_STALL: Duration = Duration::from_secs(30);

/// Blocking I/O with no delay and a read timeout of [`RAW_COPY_STALL`].
fn configure(s: &TcpStream) -> std::io::Result<()> {
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(RAW_COPY_STALL))
}

/// The next connection on a non-blocking `listener`, as a configured blocking stream; an error
/// after `limit` without one.
fn accept_within(listener: &TcpListener, limit: Duration) -> std::io::Result<TcpStream> {
    let until = Instant::now() + limit;
    loop {
        match listener.accept() {
            Ok((s, _)) => {
                s.set_nonblocking(false)?;
                configure(&s)?;
                return Ok(s);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && Instant::now() < until => {
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "no raw-copy connection came",
                ));
            }
            Err(e) => return Err(e),
        }
    }
}

/// A reference point, not the baseline: `total` bytes over one loopback connection from one
/// cache-hot `chunk`-byte buffer into another (the loopback's best case for this chunk size).
pub fn raw_tcp_hot_copy(total: u64, chunk: usize) -> std::io::Result<Duration> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let mut buf = vec![1u8; chunk];
    std::thread::scope(|scope| {
        let sender = scope.spawn(|| -> std::io::Result<()> {
            let (mut s, _) = listener.accept()?;
            s.set_nodelay(true)?;
            let src = vec![7u8; chunk];
            // An untimed warm-up pass, then the timed one.
            let mut left = 2 * total;
            while left > 0 {
                let n = left.min(chunk as u64) as usize;
                s.write_all(&src[..n])?;
                left -= n as u64;
            }
            Ok(())
        });
        let mut s = TcpStream::connect(addr)?;
        s.set_nodelay(true)?;
        let mut pass = |s: &mut TcpStream| -> std::io::Result<()> {
            let mut left = total;
            while left > 0 {
                let n = left.min(chunk as u64) as usize;
                s.read_exact(&mut buf[..n])?;
                left -= n as u64;
            }
            Ok(())
        };
        pass(&mut s)?;
        let t0 = Instant::now();
        pass(&mut s)?;
        let took = t0.elapsed();
        sender
            .join()
            .map_err(|_| std::io::Error::other("sender thread panicked"))??;
        Ok(took)
    })
}

/// A task submitted by [`LoopbackRig::submit_task`].
#[derive(Debug)]
pub struct PendingTask {
    task: kvx_core::TaskId,
    start: Instant,
    deadline: Instant,
    first: usize,
}

impl Drop for LoopbackRig {
    fn drop(&mut self) {
        let _ = self.handle.done(self.desc.request);
    }
}
