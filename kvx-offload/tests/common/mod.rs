//! A small engine for the connector tests: "engine memory" in CPU RAM, a real CPU backend, a real
//! kvx-posix file tier, and both connector halves, stepped by hand.

#![allow(dead_code)]

pub mod faults;
pub mod scenarios;

use std::path::Path;
use std::time::{Duration, Instant};

use kvx_core::*;
use kvx_offload::*;
use kvx_policy::{BreakerConfig, LoadFailurePolicy, TimeoutConfig};
use kvx_posix::PosixHandle;

pub const BLOCK: usize = 8192;
pub const BT: u32 = 16;
pub const ENGINE_BLOCKS: u32 = 64;

/// Wraps the engine's real backend in a fault injector.
pub type WrapEngine = Box<dyn FnOnce(Box<dyn Backend>) -> Box<dyn Backend>>;

pub struct Opts {
    pub host_blocks: usize,
    pub file_blocks: usize,
    pub host_delay: Duration,
    pub load_ms: u64,
    pub store_ms: u64,
    pub policy: LoadFailurePolicy,
    pub breaker: Option<BreakerConfig>,
    /// Wraps the real CPU backend of engine memory (fault injection).
    pub wrap_engine: Option<WrapEngine>,
    /// The file tier's directory is shared with other nodes.
    pub shared: Option<SharedMount>,
    pub io_engine: IoEngine,
}

impl Default for Opts {
    fn default() -> Self {
        Opts {
            host_blocks: 32,
            file_blocks: 256,
            host_delay: Duration::ZERO,
            load_ms: 2000,
            store_ms: 2000,
            policy: LoadFailurePolicy::Recompute,
            breaker: None,
            wrap_engine: None,
            shared: None,
            io_engine: IoEngine::default(),
        }
    }
}

impl Opts {
    /// The builder's config for a file tier under `dir`.
    pub fn config(&self, dir: &Path) -> OffloadConfig {
        let mut file = FileTierConfig::new(dir, self.file_blocks);
        if let Some(b) = self.breaker {
            file.breaker = b;
        }
        file.shared = self.shared.clone();
        file.io_engine = self.io_engine;
        OffloadConfig {
            block_tokens: BT,
            host_blocks: self.host_blocks,
            extra_buffers: Some(64),
            timeouts: TimeoutConfig {
                load_ms: self.load_ms,
                store_ms: self.store_ms,
            },
            load_failure: self.policy,
            file: Some(file),
            ..OffloadConfig::default()
        }
    }
}

/// The engine's KV memory as the tests touch it: CPU RAM here, a CUDA device in `tests/cuda`.
pub trait EngineBlocks {
    /// Write block `b` (its segments concatenated).
    fn write_block(&mut self, b: EngineBlockId, data: &[u8]) -> Result<(), String>;
    /// Read block `b` (its segments concatenated).
    fn read_block(&self, b: EngineBlockId) -> Result<Vec<u8>, String>;
}

impl EngineBlocks for CpuArena {
    fn write_block(&mut self, b: EngineBlockId, data: &[u8]) -> Result<(), String> {
        CpuArena::write_block(self, b, data).map_err(|e| e.to_string())
    }

    fn read_block(&self, b: EngineBlockId) -> Result<Vec<u8>, String> {
        CpuArena::read_block(self, b).map_err(|e| e.to_string())
    }
}

pub struct Rig<M: EngineBlocks = CpuArena> {
    pub sched: SchedulerSide,
    pub worker: Option<WorkerSide>,
    pub runtime: Option<OffloadRuntime>,
    pub files: PosixHandle,
    /// The engine's memory.
    pub arena: M,
    pub out: WorkerOutput,
    /// Preemption fences `start_step` handed back because they did not hold yet.
    pub fences: Vec<PreemptionFence>,
}

impl<M: EngineBlocks> Drop for Rig<M> {
    fn drop(&mut self) {
        self.worker.take();
        self.runtime.take();
    }
}

/// Deterministic content of the block keyed `key`.
pub fn content(key: BlockKey) -> Vec<u8> {
    let mut x = key.0 as u64 ^ (key.0 >> 64) as u64 ^ 0x9E37_79B9_7F4A_7C15;
    (0..BLOCK)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Prefix-chained keys of a sequence: `shared` leading blocks common to every sequence with
/// the same `prefix_seed`, then `own` blocks unique to `seq`.
pub fn keys(prefix_seed: u64, shared: usize, seq: u64, own: usize) -> Vec<BlockKey> {
    let mut out = Vec::new();
    let mut parent = None;
    for i in 0..shared {
        let k = BlockKey::chain(parent, format!("p{prefix_seed}-{i}").as_bytes());
        out.push(k);
        parent = Some(k);
    }
    for i in 0..own {
        let k = BlockKey::chain(parent, format!("s{seq}-{i}").as_bytes());
        out.push(k);
        parent = Some(k);
    }
    out
}

/// A builder-made connector over a host arena of `ENGINE_BLOCKS` (each block filled with
/// 0xAB) and a file tier in `dir`; `o.host_delay` slows every engine copy.
pub fn rig(dir: &Path, o: Opts) -> Rig {
    let mut arena = CpuArena::per_layer(2, BLOCK / 2, ENGINE_BLOCKS).unwrap();
    for b in 0..ENGINE_BLOCKS {
        arena
            .write_block(EngineBlockId(b), &vec![0xAB; BLOCK])
            .unwrap();
    }
    // SAFETY: the arena outlives the driver (Rig drops the runtime first); tests touch engine
    // blocks only when no load or store on them is in flight.
    let host = unsafe {
        CpuBackend::new(
            arena.layout().clone(),
            CpuBackendConfig {
                threads: 2,
                delay: o.host_delay,
            },
        )
        .unwrap()
    };
    let cfg = o.config(dir);
    let engine: Box<dyn Backend> = match o.wrap_engine {
        Some(wrap) => wrap(Box::new(host)),
        None => Box::new(host),
    };
    let memory = EngineMemory::backend(engine, BLOCK, ENGINE_BLOCKS);
    Rig::new(OffloadBuilder::new(cfg, memory).build().unwrap(), arena)
}

impl<M: EngineBlocks> Rig<M> {
    /// A rig over what the builder made and the engine memory it serves.
    pub fn new(offload: Offload, arena: M) -> Rig<M> {
        let Offload {
            scheduler,
            worker,
            runtime,
        } = offload;
        Rig {
            sched: scheduler,
            worker: Some(worker),
            files: runtime.files().unwrap().clone(),
            runtime: Some(runtime),
            arena,
            out: WorkerOutput::default(),
            fences: Vec::new(),
        }
    }

    pub fn w(&mut self) -> &mut WorkerSide {
        self.worker.as_mut().unwrap()
    }

    pub fn driver(&self) -> &DriverHandle {
        self.runtime.as_ref().unwrap().driver().unwrap()
    }

    /// The engine computed `keys` into `blocks`.
    pub fn compute(&mut self, keys: &[BlockKey], blocks: &[u32]) {
        for (k, b) in keys.iter().zip(blocks) {
            self.arena
                .write_block(EngineBlockId(*b), &content(*k))
                .unwrap();
        }
    }

    pub fn scribble(&mut self, blocks: &[u32]) {
        for b in blocks {
            self.arena
                .write_block(EngineBlockId(*b), &vec![0x5A; BLOCK])
                .unwrap();
        }
    }

    /// True when each engine block holds the content of its key.
    pub fn holds(&self, keys: &[BlockKey], blocks: &[u32]) -> bool {
        keys.iter()
            .zip(blocks)
            .all(|(k, b)| self.arena.read_block(EngineBlockId(*b)).unwrap() == content(*k))
    }

    pub fn save(&mut self, req: u64, keys: &[BlockKey], blocks: &[u32]) -> Option<JobId> {
        let pairs: Vec<_> = keys
            .iter()
            .copied()
            .zip(blocks.iter().map(|b| EngineBlockId(*b)))
            .collect();
        self.sched.save_blocks(RequestId(req), &pairs)
    }

    /// One engine step: metadata to the worker, its output back to the scheduler.
    pub fn step(&mut self) -> WorkerOutput {
        let meta = self.sched.build_meta();
        match self.w().start_step(meta) {
            Ok(StepStarted::Clear) => {}
            Ok(StepStarted::FenceOutstanding(f)) => self.fences.push(f),
            Err(e) => panic!("start_step: {e}"),
        }
        let out = self.w().get_finished().unwrap();
        self.sched.update_from_worker(&out);
        self.out.merge(out.clone());
        out
    }

    /// Step until `done(self)` or the timeout; true if done.
    pub fn step_until(&mut self, timeout: Duration, done: impl FnMut(&Self) -> bool) -> bool {
        self.step_until_last_miss(Instant::now(), timeout, done)
            .is_some()
    }

    /// Step until `done(self)`, for at most `timeout` after `since`; returns how long after
    /// `since` the last step that still found it false began (zero when the first step found
    /// it true), `None` on timeout. A bound held there is kvx's own: the test's stepping and
    /// sleeping after that step are not.
    pub fn step_until_last_miss(
        &mut self,
        since: Instant,
        timeout: Duration,
        mut done: impl FnMut(&Self) -> bool,
    ) -> Option<Duration> {
        let mut missed_at = since;
        loop {
            let stepped = Instant::now();
            self.step();
            if done(self) {
                return Some(missed_at.saturating_duration_since(since));
            }
            missed_at = stepped;
            if stepped.saturating_duration_since(since) >= timeout {
                return None;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Load `keys` for `req` into `blocks` if all are offloaded; returns the tokens matched.
    pub fn load(&mut self, req: u64, keys: &[BlockKey], blocks: &[u32]) -> Option<u64> {
        let n = self
            .sched
            .get_num_new_matched_tokens(RequestId(req), keys, 0)?;
        let nb = (n / BT as u64) as usize;
        let alloc: Vec<EngineBlockId> = blocks[..nb].iter().map(|b| EngineBlockId(*b)).collect();
        self.sched
            .update_state_after_alloc(RequestId(req), &alloc)
            .unwrap();
        Some(n)
    }

    /// The engine computed `keys` into `blocks` for `req`, saved them and finished; step until
    /// everything is stored and the connector is idle.
    pub fn offload(
        &mut self,
        req: u64,
        keys: &[BlockKey],
        blocks: &[u32],
        timeout: Duration,
    ) -> bool {
        self.compute(keys, blocks);
        self.save(req, keys, blocks);
        self.finish(req);
        self.settle(timeout)
    }

    pub fn finish(&mut self, req: u64) -> bool {
        self.sched.request_finished(RequestId(req))
    }

    /// Step until the connector and tracker are idle; true if they got there.
    pub fn settle(&mut self, timeout: Duration) -> bool {
        let end = Instant::now() + timeout;
        loop {
            self.step();
            let (_, empty) = self.driver().stats().unwrap();
            if empty
                && self.w().in_flight() == 0
                && self.sched.request_count() == 0
                && self.sched.job_count() == 0
                && self.sched.manager().is_quiet()
            {
                return true;
            }
            if Instant::now() >= end {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Every pool buffer is either in the host tier or back in the pool.
    pub fn pool_whole(&mut self) -> bool {
        let held = self.w().host_blocks();
        let pool = self.w().pool().clone();
        pool.lent() == held
    }
}
