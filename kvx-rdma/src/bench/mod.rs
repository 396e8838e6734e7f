//! A producer and a consumer over loopback TCP in one process, and the raw socket copy they
//! are measured against. Shared by `kvx bench remote` and the criterion benchmark.

use std::sync::Arc;
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

mod raw;
mod raw_tasks;

pub use raw::{RawTcpCopy, raw_tcp_hot_copy};
pub use raw_tasks::RawTcpTasks;

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
    arena: Arc<AlignedBuf>,
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
            MemoryKind::Cpu,
            block_bytes,
            blocks,
        )
        .map_err(bad)?;
        // SAFETY: the arena is a field of the rig, dropped after the server and the exporter
        // (field order; the raw copy's threads may hold it longer); nothing writes it after
        // the fill above.
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
            arena: Arc::new(arena),
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

    /// The physical path for the same bytes over `connections` plain loopback TCP connections
    /// (as many as kvx has load tasks in flight, each on its own connection), into as many
    /// destination buffers as the staging pool has; see [`RawTcpCopy`].
    pub fn raw_tcp_copy(&self, connections: usize) -> std::io::Result<RawTcpCopy> {
        RawTcpCopy::start(
            self.arena.clone(),
            self.block_bytes,
            connections,
            self.staging,
        )
    }

    /// A reference point: the same bytes over `connections` plain loopback TCP connections in
    /// request/response tasks of `task_blocks` blocks, each connection's one at a time, into as
    /// many destination buffers as the staging pool has; see [`RawTcpTasks`].
    pub fn raw_tcp_tasks(
        &self,
        task_blocks: usize,
        connections: usize,
    ) -> std::io::Result<RawTcpTasks> {
        RawTcpTasks::start(
            self.arena.clone(),
            self.block_bytes,
            task_blocks,
            connections,
            self.staging,
        )
    }
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
