//! The measurement rig behind `kvx bench cuda` and the criterion bench `benches/benches/cuda.rs`:
//! the backend's copy of a set of blocks, next to a plain synchronous `cuMemcpyHtoD`/`DtoH` of
//! the same total bytes from one contiguous pinned buffer, measured in the same run.
//!
//! Cases: 32 contiguous 2 MiB blocks, and 1,024 scattered 64 KiB blocks picked from 4,096 (each
//! 64 MiB in all). Every block has its own pinned buffer, as in a real host tier.

use std::time::{Duration, Instant};

use kvx_core::{
    Backend, BlockKey, Buf, Direction, EngineBlockId, KvLayout, MemoryKind, Op, OpBlock, OpId,
    PoolBuf, RequestId, TaskId, WaitOutcome,
};
use rand::SeedableRng;

use crate::CudaBackend;
use crate::config::CudaBackendConfig;
use crate::device::{CudaDevice, DeviceMem};
use crate::error::CudaError;
use crate::pinned::PinnedPool;

/// A benchmark case.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Case {
    /// 32 adjacent 2 MiB engine blocks.
    Contiguous,
    /// 1,024 random 64 KiB engine blocks out of 4,096.
    Scattered,
}

impl Case {
    /// Short name for tables and JSON.
    pub fn label(self) -> &'static str {
        match self {
            Case::Contiguous => "contiguous 32 x 2 MiB",
            Case::Scattered => "scattered 1024 x 64 KiB",
        }
    }

    /// Bytes of one block.
    pub fn block_bytes(self) -> usize {
        match self {
            Case::Contiguous => 2 << 20,
            Case::Scattered => 64 << 10,
        }
    }

    /// Blocks in one op.
    pub fn blocks_per_op(self) -> usize {
        match self {
            Case::Contiguous => 32,
            Case::Scattered => 1024,
        }
    }

    fn engine_blocks(self) -> u32 {
        match self {
            Case::Contiguous => 32,
            Case::Scattered => 4096,
        }
    }

    /// Minimum kvx/plain ratio the issue asks for.
    pub fn target_ratio(self) -> f64 {
        match self {
            Case::Contiguous => 0.9,
            Case::Scattered => 0.8,
        }
    }
}

/// Device memory, pinned buffers and a backend for one case.
pub struct Rig {
    case: Case,
    // Field order: the backend drops (draining its copies) before the memory it copies.
    backend: CudaBackend,
    bufs: Vec<PoolBuf>,
    plain_buf: PoolBuf,
    blocks: Vec<EngineBlockId>,
    next_op: u64,
    _pool: PinnedPool,
    _plain: PinnedPool,
    engine: DeviceMem,
}

impl Rig {
    /// Allocate and register everything for `case` on `device`; the backend runs with `cfg`
    /// (its name set here).
    pub fn new(device: &CudaDevice, case: Case, cfg: CudaBackendConfig) -> Result<Rig, CudaError> {
        let bb = case.block_bytes();
        let n = case.engine_blocks();
        let engine = device.alloc(bb * n as usize)?;
        engine.fill(0x5a)?;
        let layout = KvLayout::contiguous(
            engine.ptr() as usize,
            MemoryKind::Cuda(device.ordinal()),
            bb,
            n,
        )?;
        let cfg = CudaBackendConfig {
            name: format!("cuda-bench-{}", device.ordinal()),
            ..cfg
        };
        // SAFETY: `engine` is device memory of `device` covering the layout; the Rig drops the
        // backend (which drains its copies) before `engine`, and reads no block while an op runs.
        let mut backend = unsafe { CudaBackend::new(device, layout, cfg)? };
        let pool = backend.pinned_pool(case.blocks_per_op(), bb)?;
        let total = bb * case.blocks_per_op();
        let plain = device.pinned_pool(1, total)?;
        let bufs: Vec<PoolBuf> = std::iter::from_fn(|| pool.take()).collect();
        let plain_buf = plain
            .take()
            .ok_or_else(|| CudaError::BadConfig("empty baseline pool".into()))?;
        let blocks = match case {
            Case::Contiguous => (0..n).map(EngineBlockId).collect(),
            Case::Scattered => {
                let mut rng = rand::rngs::StdRng::seed_from_u64(0x006b_7678_6375_6461);
                rand::seq::index::sample(&mut rng, n as usize, case.blocks_per_op())
                    .into_iter()
                    .map(|i| EngineBlockId(i as u32))
                    .collect()
            }
        };
        Ok(Rig {
            case,
            backend,
            bufs,
            plain_buf,
            blocks,
            next_op: 1,
            _pool: pool,
            _plain: plain,
            engine,
        })
    }

    /// Bytes one measurement moves.
    pub fn bytes(&self) -> u64 {
        (self.case.block_bytes() * self.case.blocks_per_op()) as u64
    }

    /// The backend's counters.
    pub fn stats(&self) -> crate::CudaStats {
        self.backend.stats()
    }

    /// Whether the backend submits batched copies.
    pub fn batching(&self) -> bool {
        self.backend.batching()
    }

    /// One op of all the case's blocks through the backend: submit → completion.
    pub fn kvx(&mut self, dir: Direction) -> Result<Duration, CudaError> {
        let id = OpId(self.next_op);
        self.next_op += 1;
        let blocks = self
            .bufs
            .drain(..)
            .zip(&self.blocks)
            .map(|(buf, &e)| OpBlock {
                key: BlockKey(u128::from(e.0)),
                engine: Some(e),
                buf: Buf::Owned(buf),
            })
            .collect();
        let t0 = Instant::now();
        let op = Op {
            id,
            task: TaskId(id.0),
            request: RequestId(0),
            dir,
            deadline: t0 + Duration::from_secs(60),
            blocks,
        };
        if let Err(e) = self.backend.submit(op) {
            self.recover(e.op);
            return Err(CudaError::CopyFailed(format!("submit refused: {}", e.kind)));
        }
        if self.backend.wait(&[id], t0 + Duration::from_secs(60)) == WaitOutcome::TimedOut {
            return Err(CudaError::Stuck {
                what: format!("benchmark op {id}"),
                secs: 60,
            });
        }
        let dt = t0.elapsed();
        let mut out = Vec::new();
        self.backend.poll(&mut out);
        let mut failed = None;
        for c in out {
            if let Some(Err(e)) = c.results.iter().find(|r| r.is_err()) {
                failed = Some(e.to_string());
            }
            self.recover(c.op);
        }
        match failed {
            Some(e) => Err(CudaError::CopyFailed(e)),
            None => Ok(dt),
        }
    }

    fn recover(&mut self, op: Op) {
        for b in op.blocks {
            if let Buf::Owned(p) = b.buf {
                self.bufs.push(p);
            }
        }
    }

    /// The physical path: one synchronous `cuMemcpyHtoD`/`DtoH` of the same bytes.
    pub fn plain(&mut self, dir: Direction) -> Result<Duration, CudaError> {
        let len = self.bytes() as usize;
        let t0 = Instant::now();
        match dir {
            // SAFETY: `plain_buf` is a pinned buffer of `len` bytes we own for the call.
            Direction::Load => unsafe {
                self.engine
                    .copy_from_host_raw(0, self.plain_buf.as_ptr(), len)?
            },
            // SAFETY: as above, exclusively borrowed.
            Direction::Store => unsafe {
                self.engine
                    .copy_to_host_raw(0, self.plain_buf.as_mut_ptr(), len)?
            },
        }
        Ok(t0.elapsed())
    }
}

/// One result row: the backend next to the plain copy, same bytes, same run.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// Case label.
    pub case: &'static str,
    /// `h2d` (load) or `d2h` (store).
    pub dir: &'static str,
    /// Whether the backend used batched copies.
    pub batched: bool,
    /// Bytes per measurement.
    pub bytes: u64,
    /// Median backend throughput, GB/s (1e9 bytes).
    pub kvx_gbps: f64,
    /// Median plain-copy throughput, GB/s.
    pub plain_gbps: f64,
    /// `kvx_gbps / plain_gbps`.
    pub ratio: f64,
    /// The target ratio for this case.
    pub target: f64,
    /// Driver copy calls per backend op.
    pub calls_per_op: f64,
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort_unstable();
    v[v.len() / 2]
}

/// Measure `case` in direction `dir`: `iters` backend ops interleaved with `iters` plain copies
/// (after 3 warm-ups of each).
pub fn measure(rig: &mut Rig, dir: Direction, iters: usize) -> Result<Sample, CudaError> {
    let iters = iters.max(1);
    for _ in 0..3 {
        rig.kvx(dir)?;
        rig.plain(dir)?;
    }
    let before = rig.stats();
    let (mut k, mut p) = (Vec::with_capacity(iters), Vec::with_capacity(iters));
    for _ in 0..iters {
        k.push(rig.kvx(dir)?);
        p.push(rig.plain(dir)?);
    }
    let after = rig.stats();
    let gbps = |d: Duration| rig.bytes() as f64 / d.as_secs_f64().max(1e-12) / 1e9;
    let (kvx_gbps, plain_gbps) = (gbps(median(k)), gbps(median(p)));
    Ok(Sample {
        case: rig.case.label(),
        dir: match dir {
            Direction::Load => "h2d",
            Direction::Store => "d2h",
        },
        batched: rig.batching(),
        bytes: rig.bytes(),
        kvx_gbps,
        plain_gbps,
        ratio: kvx_gbps / plain_gbps,
        target: rig.case.target_ratio(),
        calls_per_op: (after.api_calls - before.api_calls) as f64
            / (after.ops - before.ops).max(1) as f64,
    })
}
