//! Test fixture: engine memory on the GPU in either layout, fresh random data, poison, and
//! byte-exact readback.

use std::time::{Duration, Instant};

use kvx_core::{
    Backend, BlockKey, Buf, Direction, EngineBlockId, KvLayout, MemoryKind, Op, OpBlock,
    OpCompletion, OpId, Region, RequestId, TaskId, WaitOutcome,
};
use kvx_cuda::{CudaDevice, CudaError, DeviceMem};
use kvx_cuda_standin::control::Standin;
use libtest_mimic::Failed;
use rand::rngs::SmallRng;
use rand::{Rng, RngCore, SeedableRng};

/// `Err(Failed)` with a message unless `cond`.
macro_rules! ensure {
    ($cond:expr, $($msg:tt)+) => {
        if !$cond {
            return Err(format!($($msg)+).into());
        }
    };
}
pub(crate) use ensure;

/// The device a trial runs on: a real GPU (every trial shares device 0), or the CPU stand-in
/// for the driver (each trial has a device of its own, so its knobs touch no other trial).
#[derive(Clone)]
pub struct Gpu {
    pub dev: CudaDevice,
    /// The stand-in's knobs, when the driver library is the stand-in.
    pub standin: Option<Standin>,
}

/// How slow the stand-in makes each copy of a trial that needs a long one.
pub const STANDIN_COPY_DELAY: Duration = Duration::from_millis(250);

impl Gpu {
    /// `(block bytes, blocks)` of a copy that must outlast a trial's short waits: `gpu` on a
    /// real device (sized to take long there); on the stand-in 8 blocks of 64 KiB, with each
    /// copy on this trial's device slowed by [`STANDIN_COPY_DELAY`].
    pub fn long_copy(&self, gpu: (usize, u32)) -> (usize, u32) {
        match &self.standin {
            None => gpu,
            Some(s) => {
                s.set_copy_delay(self.dev.ordinal(), STANDIN_COPY_DELAY);
                (64 << 10, 8)
            }
        }
    }
}

impl std::ops::Deref for Gpu {
    type Target = CudaDevice;
    fn deref(&self) -> &CudaDevice {
        &self.dev
    }
}

/// A fresh random generator (new seed each run, printed so a failure can be replayed).
pub fn fresh_rng(test: &str) -> SmallRng {
    let seed: u64 = rand::random();
    println!("{test}: seed {seed:#x}");
    SmallRng::seed_from_u64(seed)
}

/// A random byte that is never zero (poison must not look like freshly zeroed memory).
pub fn poison_byte(rng: &mut SmallRng) -> u8 {
    rng.random_range(1..=255u8)
}

/// Engine memory: one device allocation and a layout over it.
pub struct Engine {
    pub mem: DeviceMem,
    pub layout: KvLayout,
}

impl Engine {
    /// Cross-layer: `n` blocks of `block` contiguous bytes.
    pub fn cross(dev: &CudaDevice, block: usize, n: u32) -> Result<Engine, CudaError> {
        let mem = dev.alloc(block * n as usize)?;
        let layout = KvLayout::contiguous(
            mem.ptr() as usize,
            MemoryKind::Cuda(dev.ordinal()),
            block,
            n,
        )?;
        Ok(Engine { mem, layout })
    }

    /// Per layer: `regions` regions (layers × K/V) of `n` segments of `seg` bytes each.
    pub fn per_layer(
        dev: &CudaDevice,
        regions: usize,
        seg: usize,
        n: u32,
    ) -> Result<Engine, CudaError> {
        let region_bytes = seg * n as usize;
        let mem = dev.alloc(region_bytes * regions)?;
        let layout = KvLayout::new(
            (0..regions)
                .map(|r| Region {
                    base: mem.ptr() as usize + r * region_bytes,
                    kind: MemoryKind::Cuda(dev.ordinal()),
                    stride: seg,
                    segment_len: seg,
                })
                .collect(),
            n,
        )?;
        Ok(Engine { mem, layout })
    }

    /// The whole allocation, read back.
    pub fn snapshot(&self) -> Result<Vec<u8>, CudaError> {
        let mut all = vec![0u8; self.mem.len()];
        self.mem.read(0, &mut all)?;
        Ok(all)
    }

    /// Block `b`'s bytes (segments concatenated) inside a snapshot.
    pub fn block_of(&self, snap: &[u8], b: EngineBlockId) -> Vec<u8> {
        let base = self.mem.ptr() as usize;
        let mut out = Vec::with_capacity(self.layout.block_bytes());
        for (addr, len) in self.layout.segments(b).expect("block in range") {
            out.extend_from_slice(&snap[addr - base..addr - base + len]);
        }
        out
    }

    /// Write block `b` (segments concatenated).
    pub fn write_block(&self, b: EngineBlockId, data: &[u8]) -> Result<(), CudaError> {
        let base = self.mem.ptr() as usize;
        let mut pos = 0;
        for (addr, len) in self.layout.segments(b)? {
            self.mem.write(addr - base, &data[pos..pos + len])?;
            pos += len;
        }
        Ok(())
    }
}

/// Distinct random blocks out of `n`: streaks of 1..=8 adjacent blocks at random places (so
/// both coalescable and scattered runs occur), in random order, about `want` of them.
pub fn pick_blocks(rng: &mut SmallRng, n: u32, want: usize) -> Vec<EngineBlockId> {
    let mut taken = vec![false; n as usize];
    let mut out = Vec::new();
    while out.len() < want {
        let start = rng.random_range(0..n);
        let len = rng.random_range(1..=8u32);
        for b in start..(start + len).min(n) {
            if !taken[b as usize] {
                taken[b as usize] = true;
                out.push(EngineBlockId(b));
            }
        }
    }
    use rand::seq::SliceRandom;
    out.shuffle(rng);
    out
}

/// Random bytes (never all one value) for a block.
pub fn random_block(rng: &mut SmallRng, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    rng.fill_bytes(&mut v);
    v
}

/// An op of `blocks` for direct backend use.
pub fn op(id: u64, dir: Direction, blocks: Vec<(EngineBlockId, Buf)>) -> Op {
    Op {
        id: OpId(id),
        task: TaskId(id),
        request: RequestId(id),
        dir,
        deadline: Instant::now() + Duration::from_secs(60),
        blocks: blocks
            .into_iter()
            .map(|(e, buf)| OpBlock {
                key: BlockKey(u128::from(e.0)),
                engine: Some(e),
                buf,
            })
            .collect(),
    }
}

/// Wait up to 60 s for `ids` and collect their completions.
pub fn finish(backend: &mut dyn Backend, ids: &[OpId]) -> Result<Vec<OpCompletion>, Failed> {
    let outcome = backend.wait(ids, Instant::now() + Duration::from_secs(60));
    ensure!(
        outcome == WaitOutcome::Completed,
        "ops {ids:?} not complete after 60 s"
    );
    let mut out = Vec::new();
    backend.poll(&mut out);
    ensure!(
        out.len() == ids.len(),
        "wait said complete but poll returned {} of {} completions",
        out.len(),
        ids.len()
    );
    Ok(out)
}
