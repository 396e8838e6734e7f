//! The CUDA backend: copies between engine GPU memory and pinned host buffers.
//!
//! - Loads (host → device) and stores (device → host) each have their own non-blocking stream,
//!   so a flood of stores never queues behind loads the next step needs.
//! - `submit` validates each block, plans the op's runs (coalescing contiguous ones, see
//!   [`crate::plan`]), queues them with one batched call (or one call per run), records the op's
//!   event and returns. It never waits for the GPU; past `max_inflight_ops` it refuses with
//!   `Busy` so the driver's queue cannot fill up and block it.
//! - A completer thread per stream waits for each op's event in order (asking it every
//!   `completion_poll`, or sleeping in `cuEventSynchronize`) and completes the op, then calls
//!   the Notifier. `poll` only takes what the completers queued: it never blocks.
//! - `wait(ops, until)` sleeps on a condition variable until those ops' events completed (the
//!   preemption flush), or `until` passes.
//! - Deadlines are the tracker's business: the task of an op that never returns gets its
//!   verdict at its deadline from kvx-core's tracker, whatever the stream does.
//! - `cancel` is honest about what CUDA allows: nothing withdraws a copy already queued on a
//!   stream (there is no per-op abort; only destroying the context would stop it, and that
//!   takes every other op and the engine's own memory with it). So `cancel` marks the op
//!   abandoned and counts it; it does not stop waiting for it. The op stays a zombie holding
//!   its pinned buffers until its event completes, `wait` (the preemption fence) still waits
//!   for it, and when it finally completes its late result is counted and handed back like any
//!   other, so the tracker returns the buffers to their pool.

mod lane;
mod ledger;
mod timer_slack;
#[cfg(test)]
mod wedged_tests;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Instant;

use kvx_core::{
    Backend, BlockError, Buf, Direction, EngineBlockId, KvLayout, MemoryKind, Notifier, Op,
    OpBlock, OpCompletion, OpId, SubmitError, SubmitErrorKind, WaitOutcome,
};
use rustc_hash::FxHashSet;

use crate::config::{BatchMode, CudaBackendConfig};
use crate::device::CudaDevice;
use crate::driver::Ctx;
use crate::error::CudaError;
use crate::order::EngineOrder;
use crate::pinned::{PinnedPool, PinnedRanges};
use crate::plan;
use crate::stream::{self, CopyDir, Event, Stream};
use lane::{CudaFence, FencePart, InFlight, Lane};
pub(crate) use ledger::Ledger;
use ledger::OpState;
pub use ledger::{CudaStats, CudaStatsHandle};

/// Copies KV blocks between engine memory on one CUDA device and pinned host buffers.
pub struct CudaBackend {
    cfg: CudaBackendConfig,
    device: CudaDevice,
    layout: KvLayout,
    pinned: PinnedRanges,
    /// `[loads (HtoD), stores (DtoH)]`, `copy_streams` each (an op starts on the first).
    streams: [Vec<Arc<Stream>>; 2],
    /// The ops queued on each stream, in the same order.
    lanes: [Arc<Lane<CudaFence>>; 2],
    ledger: Arc<Ledger>,
    batch: AtomicBool,
    completers: Vec<JoinHandle<()>>,
}

impl CudaBackend {
    /// A backend over `layout`, whose regions must all be memory of `device`.
    ///
    /// # Safety
    /// Every region of `layout` must be device memory of `device` (in its primary context),
    /// valid for reads and writes for as long as this backend lives (it drains its copies when
    /// dropped), and the caller must not read or write a block while an op naming it is
    /// outstanding: wait for the task's report or a fence, as with kvx-core's `CpuBackend`.
    /// The engine's kernels that write a block must also come before the op that stores it,
    /// and those that touch a block being loaded before or after the load (the backend's
    /// streams do not order against the engine's by themselves): have them finished, or order
    /// the backend after them with [`CudaBackend::engine_order`].
    pub unsafe fn new(
        device: &CudaDevice,
        layout: KvLayout,
        cfg: CudaBackendConfig,
    ) -> Result<CudaBackend, CudaError> {
        cfg.validate()?;
        check_layout(&layout, device.ordinal())?;
        let ctx = device.ctx().clone();
        let direction = || -> Result<Vec<Arc<Stream>>, CudaError> {
            (0..cfg.copy_streams)
                .map(|_| Stream::new(ctx.clone()).map(Arc::new))
                .collect()
        };
        let streams = [direction()?, direction()?];
        let lanes = [Arc::new(Lane::new()), Arc::new(Lane::new())];
        let batch = cfg.batch == BatchMode::Auto && ctx.batch_copy();
        let mut backend = CudaBackend {
            cfg,
            device: device.clone(),
            layout,
            pinned: PinnedRanges::default(),
            streams,
            lanes,
            ledger: Arc::new(Ledger::new()),
            batch: AtomicBool::new(batch),
            completers: Vec::new(),
        };
        for (lane, what) in backend.lanes.iter().zip(["load", "store"]) {
            let (lane, ledger, ctx) = (lane.clone(), backend.ledger.clone(), ctx.clone());
            let polls = backend.cfg.completion_poll.is_some();
            let handle = std::thread::Builder::new()
                .name(format!("kvx-cuda-{what}"))
                .spawn(move || {
                    if polls {
                        timer_slack::tighten();
                    }
                    if let Err(e) = ctx.bind() {
                        tracing::error!(error = %e, "kvx-cuda completer cannot bind the CUDA context");
                    }
                    lane::run(lane, ledger)
                })
                .map_err(|e| CudaError::Spawn {
                    what: format!("the kvx-cuda {what} completer"),
                    reason: e.to_string(),
                })?;
            backend.completers.push(handle);
        }
        Ok(backend)
    }

    /// Create a pinned pool on this backend's device (pinned in chunks of
    /// [`CudaBackendConfig::pin_chunk_bytes`]) and accept it.
    pub fn pinned_pool(&mut self, count: usize, buf_size: usize) -> Result<PinnedPool, CudaError> {
        let pool = self
            .device
            .pinned_pool_in_chunks(count, buf_size, self.cfg.pin_chunk_bytes)?;
        self.accept_pool(&pool);
        Ok(pool)
    }

    /// Let ops use buffers of `pool` (e.g. a host tier's pool shared with other backends). The
    /// backend keeps the pool's registration alive until it is dropped.
    pub fn accept_pool(&mut self, pool: &PinnedPool) {
        self.pinned.add(pool.registration());
    }

    /// The device.
    pub fn device(&self) -> &CudaDevice {
        &self.device
    }

    /// The engine layout this backend serves.
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// The handle that orders this backend's copies after the engine's CUDA stream, each step
    /// (see [`EngineOrder::order_after`]); take it before the backend moves into a driver.
    pub fn engine_order(&self) -> Result<EngineOrder, CudaError> {
        let streams = self.streams.iter().flatten().cloned().collect();
        EngineOrder::new(self.ctx().clone(), streams)
    }

    /// Whether ops are submitted with one batched call (config allows it and the driver has it).
    pub fn batching(&self) -> bool {
        self.batch.load(Ordering::Relaxed)
    }

    /// The counters now.
    pub fn stats(&self) -> CudaStats {
        self.ledger.snapshot()
    }

    /// A handle to read the counters later (e.g. after the backend moved into a driver).
    pub fn stats_handle(&self) -> CudaStatsHandle {
        CudaStatsHandle {
            ledger: self.ledger.clone(),
        }
    }

    fn ctx(&self) -> &Arc<Ctx> {
        self.device.ctx()
    }

    fn take_event(&self) -> Result<Event, CudaError> {
        let pooled = kvx_core::lock(&self.ledger.events).pop();
        match pooled {
            Some(ev) => Ok(ev),
            None => Event::new(self.ctx().clone()),
        }
    }

    /// Check one block; returns its engine block and the host address of its buffer.
    fn check_block(
        &self,
        dir: Direction,
        b: &mut OpBlock,
        seen: &mut FxHashSet<EngineBlockId>,
    ) -> Result<(EngineBlockId, usize), BlockError> {
        let bb = self.layout.block_bytes();
        let engine = b
            .engine
            .ok_or_else(|| BlockError::Invalid("a CUDA op block names no engine block".into()))?;
        self.layout
            .check(engine)
            .map_err(|e| BlockError::Invalid(e.to_string()))?;
        let addr = match (dir, &mut b.buf) {
            (Direction::Load, buf) => {
                if buf.len() < bb {
                    return Err(BlockError::Invalid(format!(
                        "source buffer holds {} bytes, block {engine} needs {bb}",
                        buf.len()
                    )));
                }
                buf.as_slice().as_ptr() as usize
            }
            (Direction::Store, Buf::Owned(buf)) => {
                if buf.capacity() < bb {
                    return Err(BlockError::Invalid(format!(
                        "destination buffer holds {} bytes, block {engine} needs {bb}",
                        buf.capacity()
                    )));
                }
                buf.set_len(bb);
                buf.as_mut_ptr() as usize
            }
            (Direction::Store, Buf::Shared(_)) => {
                return Err(BlockError::Invalid(format!(
                    "store of block {engine} needs an owned destination buffer"
                )));
            }
        };
        if !self.pinned.contains(addr, bb) {
            return Err(BlockError::Invalid(format!(
                "buffer of block {engine} is not pinned memory accepted by backend {} \
                 (use CudaBackend::pinned_pool or accept_pool)",
                self.cfg.name
            )));
        }
        if !seen.insert(engine) {
            return Err(BlockError::Invalid(format!(
                "block {engine} appears twice in one op"
            )));
        }
        Ok((engine, addr))
    }
}

fn check_layout(layout: &KvLayout, ordinal: u32) -> Result<(), CudaError> {
    for (i, r) in layout.regions().iter().enumerate() {
        if r.kind != MemoryKind::Cuda(ordinal) {
            return Err(CudaError::BadLayout(format!(
                "region {i} is {:?} memory; this backend copies to and from CUDA device {ordinal}",
                r.kind
            )));
        }
    }
    Ok(())
}

impl Backend for CudaBackend {
    fn name(&self) -> &str {
        &self.cfg.name
    }

    fn touches_engine_memory(&self) -> bool {
        true
    }

    fn set_notifier(&mut self, notifier: Notifier) {
        self.ledger.board.set_notifier(notifier);
    }

    fn submit(&mut self, mut op: Op) -> Result<(), SubmitError> {
        let in_flight = self.ledger.board.pending_len();
        if in_flight >= self.cfg.max_inflight_ops {
            return Err(SubmitError {
                op,
                kind: SubmitErrorKind::Busy(format!(
                    "{in_flight} CUDA ops in flight (max_inflight_ops)"
                )),
            });
        }
        let event = match self.ctx().bind().and_then(|()| self.take_event()) {
            Ok(ev) => ev,
            Err(e) => {
                return Err(SubmitError {
                    op,
                    kind: SubmitErrorKind::Unavailable(e.to_string()),
                });
            }
        };
        let dir = op.dir;
        let mut seen = FxHashSet::default();
        let mut results = Vec::with_capacity(op.blocks.len());
        let mut targets = Vec::with_capacity(op.blocks.len());
        let mut target_pos = Vec::with_capacity(op.blocks.len());
        for (i, b) in op.blocks.iter_mut().enumerate() {
            let r = self.check_block(dir, b, &mut seen);
            if let Ok(t) = r {
                targets.push(t);
                target_pos.push(i);
            }
            results.push(r.map(|_| ()));
        }
        let stats = &self.ledger.stats;
        stats.ops.fetch_add(1, Ordering::Relaxed);
        stats
            .blocks
            .fetch_add(op.blocks.len() as u64, Ordering::Relaxed);
        stats
            .invalid_blocks
            .fetch_add((op.blocks.len() - targets.len()) as u64, Ordering::Relaxed);
        let runs = match plan::plan(&self.layout, &targets) {
            Ok(runs) => self.pinned.split(runs),
            Err(e) => {
                // Unreachable in practice (each block was checked), but never lose the op.
                for &i in &target_pos {
                    results[i] = Err(BlockError::Invalid(e.to_string()));
                }
                Vec::new()
            }
        };
        self.ledger.board.begin(op.id, OpState::default());
        if runs.is_empty() {
            self.ledger.put_event(event);
            self.ledger.complete(OpCompletion { op, results });
            return Ok(());
        }
        let (lane, streams, copy_dir) = match dir {
            Direction::Load => (&self.lanes[0], &self.streams[0], CopyDir::HtoD),
            Direction::Store => (&self.lanes[1], &self.streams[1], CopyDir::DtoH),
        };
        // One event per part; a part whose event cannot be had joins the others.
        let mut events = vec![event];
        for _ in 1..plan::part_count(runs.len(), streams.len()) {
            match self.take_event() {
                Ok(ev) => events.push(ev),
                Err(_) => break,
            }
        }
        let parts = plan::spread(&runs, events.len());
        let mut fence_parts = Vec::with_capacity(parts.len());
        let mut failed = false;
        for ((part, stream), event) in parts.into_iter().zip(streams).zip(events) {
            if failed {
                self.ledger.put_event(event);
                continue;
            }
            // SAFETY: every run comes from a block that passed `check_block`: its host range
            // is inside a pinned registration this backend holds, in a buffer owned by `op`,
            // which stays in this backend (lane queue, then the completer) until the events
            // recorded below completed; a store's destination is an exclusively owned buffer.
            // Device ranges are segments of `layout`, which the caller of the unsafe `new`
            // vouched for. Parts never share a byte (each run is in one part).
            let enqueued = unsafe {
                stream::enqueue(
                    self.ctx(),
                    stream,
                    copy_dir,
                    part,
                    &self.batch,
                    self.cfg.min_batch_runs,
                )
            };
            match enqueued {
                Ok(calls) => stats.count(part, &calls),
                Err(e) => {
                    // Some runs may be queued already: the op still waits for this part's event.
                    failed = true;
                    stats.failed_ops.fetch_add(1, Ordering::Relaxed);
                    let msg = format!("queueing the CUDA copy failed: {e}");
                    for &i in &target_pos {
                        results[i] = Err(BlockError::Io(msg.clone()));
                    }
                }
            }
            let event = match event.record(stream) {
                Ok(()) => Some(event),
                Err(e) => {
                    tracing::warn!(error = %e, op = %op.id, "cuEventRecord failed; the completer will synchronise the stream");
                    None
                }
            };
            fence_parts.push(FencePart {
                event,
                stream: stream.clone(),
            });
        }
        let fence = CudaFence {
            parts: fence_parts,
            ctx: self.ctx().clone(),
            poll: self.cfg.completion_poll,
        };
        lane.push(InFlight { op, results, fence });
        Ok(())
    }

    fn poll(&mut self, out: &mut Vec<OpCompletion>) {
        self.ledger.board.drain(out);
    }

    fn cancel(&mut self, op: OpId) {
        // A queued DMA cannot be withdrawn: mark the op abandoned; it completes when its
        // event does, holding its buffers until then (see the module docs).
        self.ledger.abandon(op);
    }

    fn wait(&mut self, ops: &[OpId], until: Instant) -> WaitOutcome {
        self.ledger.board.wait(ops, until)
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        // Completers drain their queues (every event waited for) before exiting, so streams,
        // events and pinned registrations are released only after the last copy finished.
        for lane in &self.lanes {
            lane.shutdown();
        }
        for h in self.completers.drain(..) {
            let _ = h.join();
        }
    }
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend")
            .field("name", &self.cfg.name)
            .field("device", &self.device)
            .field("batching", &self.batching())
            .field("stats", &self.stats())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvx_core::Region;

    #[test]
    fn host_or_foreign_device_regions_are_rejected() {
        let cuda0 = KvLayout::contiguous(0x1000, MemoryKind::Cuda(0), 64, 4).unwrap();
        assert!(check_layout(&cuda0, 0).is_ok());
        assert!(matches!(
            check_layout(&cuda0, 1),
            Err(CudaError::BadLayout(_))
        ));
        let mixed = KvLayout::new(
            vec![
                Region {
                    base: 0x1000,
                    kind: MemoryKind::Cuda(0),
                    stride: 64,
                    segment_len: 64,
                },
                Region {
                    base: 0x9000,
                    kind: MemoryKind::Cpu,
                    stride: 64,
                    segment_len: 64,
                },
            ],
            4,
        )
        .unwrap();
        let err = check_layout(&mixed, 0).unwrap_err();
        assert!(err.to_string().contains("region 1"), "{err}");
    }
}
