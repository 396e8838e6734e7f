//! The one test rig of kvx-posix (feature `faults`; the crate's own unit tests always have it):
//! a store in a kvx driver on a real directory, with [`Faults`] injected around its I/O
//! engine (a stall holds every syscall's completion, a late fault the next reads or renames),
//! or the noop engine instead; staging buffers, an optional host tier, and helpers to run
//! tasks with deadlines. Integration tests enable the feature through a dev-dependency of
//! kvx-posix on itself. Never in a production build.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvx_core::*;

use crate::io::EngineOverride;
pub use crate::io::fault::{Faults, Late};
use crate::{PosixConfig, PosixError, PosixHandle, PosixStore};

/// Bound for "happens promptly" (never a performance assertion).
pub const SOON: Duration = Duration::from_secs(20);

impl PosixStore {
    /// [`PosixStore::open`] with `faults` injected around the engine.
    pub fn open_with_faults(
        cfg: PosixConfig,
        faults: Arc<Faults>,
    ) -> Result<PosixStore, PosixError> {
        PosixStore::open_with(cfg, EngineOverride::with_faults(faults))
    }

    /// [`PosixStore::open`] with the noop engine: every job completes at once without
    /// touching a file (a store succeeds, a load finds nothing).
    pub fn open_noop(cfg: PosixConfig) -> Result<PosixStore, PosixError> {
        let over = EngineOverride {
            faults: None,
            noop: true,
        };
        PosixStore::open_with(cfg, over)
    }
}

/// Key `i` of a test.
pub fn key(i: u64) -> BlockKey {
    BlockKey::chain(None, &i.to_le_bytes())
}

/// The payload the tests store under `k`, `len` bytes.
pub fn expected(k: BlockKey, len: usize) -> Vec<u8> {
    let seed = k.to_be_bytes();
    (0..len)
        .map(|i| seed[i % 16].wrapping_add((i / 16) as u8))
        .collect()
}

/// Fill `buf` with `k`'s payload of `len` bytes.
pub fn fill(buf: &mut PoolBuf, k: BlockKey, len: usize) {
    buf.set_len(len);
    buf.as_mut_slice().copy_from_slice(&expected(k, len));
}

/// Poll `cond` until it holds (true) or `within` passes (false).
pub fn wait_until(within: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + within;
    loop {
        if cond() {
            return true;
        }
        if Instant::now() >= end {
            return false;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Every file under `dir` whose name ends with `suffix`.
pub fn files_with_suffix(dir: &Path, suffix: &str) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.to_string_lossy().ends_with(suffix) {
                out.push(p);
            }
        }
    }
    out
}

/// The first failed block's error of a report, for messages.
pub fn first_error(r: &TaskReport) -> Option<BlockError> {
    r.blocks.iter().find_map(|b| b.result.clone().err())
}

/// What a [`Rig`] is built with besides the store's settings.
#[derive(Debug, Clone, Copy)]
pub struct RigShape {
    /// Staging buffers in the pool.
    pub bufs: usize,
    /// Bytes of each staging buffer (and of each host block).
    pub buf_len: usize,
    /// Blocks of a host tier (a CPU backend over an arena) beside the store; 0 for none.
    pub host_blocks: u32,
    /// Run the noop engine instead of the configured one (faults then do nothing).
    pub noop: bool,
}

impl RigShape {
    /// `bufs` staging buffers of `buf_len` bytes, no host tier, the configured engine.
    pub fn new(bufs: usize, buf_len: usize) -> RigShape {
        RigShape {
            bufs,
            buf_len,
            host_blocks: 0,
            noop: false,
        }
    }
}

/// A store in a driver (with faults around its engine), staging buffers and an optional host
/// tier. Fields drop in order: the driver (and the store in it) first, then the arena it
/// copies into, then the directory the rig made, if any.
#[must_use = "a rig dropped at once stops its driver"]
pub struct Rig {
    /// The driver.
    pub driver: Driver,
    /// The store's backend id.
    pub posix: BackendId,
    /// The host tier's backend id, if the rig has one.
    pub host: Option<BackendId>,
    /// The store's handle.
    pub files: PosixHandle,
    /// Staging buffers.
    pub pool: BufferPool,
    /// The faults injected around the store's engine.
    pub faults: Arc<Faults>,
    /// The host tier's memory, if the rig has one.
    pub arena: Option<CpuArena>,
    /// The store's first root.
    pub root: PathBuf,
    /// The temporary directory the rig made for the store, if it made one.
    pub dir: Option<tempfile::TempDir>,
}

impl Rig {
    /// A rig on `cfg` shaped as `shape`.
    pub fn open(cfg: PosixConfig, shape: RigShape) -> Rig {
        let faults = Arc::new(Faults::default());
        let root = cfg.roots.first().cloned().unwrap_or_default();
        let store = if shape.noop {
            PosixStore::open_noop(cfg)
        } else {
            PosixStore::open_with_faults(cfg, faults.clone())
        }
        .expect("open store");
        let files = store.handle();
        let arena = (shape.host_blocks > 0)
            .then(|| CpuArena::contiguous(shape.buf_len, shape.host_blocks).expect("host arena"));
        let mut b = DriverBuilder::new(DriverConfig::default());
        let posix = b.backend(Box::new(store));
        let host = arena.as_ref().map(|a| {
            // SAFETY: the arena is a field of the rig declared after the driver, so it
            // outlives the driver and its CPU backend; tests touch arena blocks only when no
            // task names them.
            let backend = unsafe {
                CpuBackend::new(a.layout().clone(), CpuBackendConfig::default())
                    .expect("CPU backend")
            };
            b.backend(Box::new(backend))
        });
        Rig {
            driver: b.spawn().expect("driver"),
            posix,
            host,
            files,
            pool: BufferPool::new(shape.bufs, shape.buf_len, DEFAULT_ALIGN).expect("pool"),
            faults,
            arena,
            root,
            dir: None,
        }
    }

    /// A rig on a fresh temporary directory of its own, `tune` adjusting the settings.
    pub fn in_temp_dir(shape: RigShape, tune: impl FnOnce(&mut PosixConfig)) -> Rig {
        Rig::in_dir(tempfile::tempdir().expect("temp dir"), shape, tune)
    }

    /// A rig on `dir`, which it keeps, `tune` adjusting the settings.
    pub fn in_dir(
        dir: tempfile::TempDir,
        shape: RigShape,
        tune: impl FnOnce(&mut PosixConfig),
    ) -> Rig {
        let mut cfg = PosixConfig::new(dir.path());
        tune(&mut cfg);
        let mut r = Rig::open(cfg, shape);
        r.dir = Some(dir);
        r
    }

    /// The host tier's backend id (panics for a rig without one).
    pub fn host(&self) -> BackendId {
        self.host.expect("a rig with a host tier")
    }

    /// The host tier's memory (panics for a rig without one).
    pub fn arena(&self) -> &CpuArena {
        self.arena.as_ref().expect("a rig with a host tier")
    }

    /// The host tier's memory, to fill (panics for a rig without one).
    pub fn arena_mut(&mut self) -> &mut CpuArena {
        self.arena.as_mut().expect("a rig with a host tier")
    }

    /// The engine's counters (the crate's own tests).
    #[cfg(test)]
    pub(crate) fn engine(&self) -> crate::io::EngineSnapshot {
        self.files.engine_snapshot()
    }

    /// A staging buffer of `k` filled with `byte` (the whole buffer).
    pub fn block(&self, k: BlockKey, byte: u8) -> OpBlock {
        let mut buf = self.pool.take().expect("a free buffer");
        buf.set_len(self.pool.buf_size());
        buf.as_mut_slice().fill(byte);
        OpBlock {
            key: k,
            engine: None,
            buf: Buf::Owned(buf),
        }
    }

    /// An empty staging buffer to load `k` into.
    pub fn empty_block(&self, k: BlockKey) -> OpBlock {
        OpBlock {
            key: k,
            engine: None,
            buf: Buf::Owned(self.pool.take().expect("a free buffer")),
        }
    }

    /// Blocks holding `keys`' payloads ([`expected`], `len` bytes), in staging buffers.
    pub fn filled(&self, keys: &[BlockKey], len: usize) -> Vec<OpBlock> {
        keys.iter()
            .map(|&k| {
                let mut buf = self.pool.take().expect("a free staging buffer");
                fill(&mut buf, k, len);
                OpBlock {
                    key: k,
                    engine: None,
                    buf: Buf::Owned(buf),
                }
            })
            .collect()
    }

    /// Empty staging buffers for loading `keys`.
    pub fn empty(&self, keys: &[BlockKey]) -> Vec<OpBlock> {
        keys.iter().map(|&k| self.empty_block(k)).collect()
    }

    /// Submit one task along `route`.
    pub fn submit_route(
        &self,
        dir: Direction,
        route: Vec<BackendId>,
        blocks: Vec<OpBlock>,
        deadline: Instant,
    ) -> TaskId {
        self.driver
            .submit(TaskSpec {
                request: RequestId(1),
                dir,
                route,
                blocks,
                deadline,
                deferred: false,
            })
            .expect("driver running")
    }

    /// Submit one task to the store alone.
    pub fn submit(&self, dir: Direction, blocks: Vec<OpBlock>, deadline: Instant) -> TaskId {
        self.submit_route(dir, vec![self.posix], blocks, deadline)
    }

    /// Wait for a task's report; panics if none comes by `until`.
    pub fn report_by(&self, t: TaskId, until: Instant) -> TaskReport {
        self.driver
            .wait_report(t, until)
            .unwrap_or_else(|| panic!("no report for {t} in time"))
    }

    /// Wait for a task's report; panics if none comes [`SOON`].
    pub fn report(&self, t: TaskId) -> TaskReport {
        self.report_by(t, Instant::now() + SOON)
    }

    /// Run one task on the store with a [`SOON`] deadline; its report.
    pub fn run(&self, dir: Direction, blocks: Vec<OpBlock>) -> TaskReport {
        let t = self.submit(dir, blocks, Instant::now() + SOON);
        self.report(t)
    }

    /// Store `k` as a whole buffer of `byte`, within `within`; the report.
    pub fn store(&self, k: BlockKey, byte: u8, within: Duration) -> TaskReport {
        let t = self.submit(
            Direction::Store,
            vec![self.block(k, byte)],
            Instant::now() + within,
        );
        self.report(t)
    }

    /// Load `k` within `within`; the report.
    pub fn load_one(&self, k: BlockKey, within: Duration) -> TaskReport {
        let t = self.submit(
            Direction::Load,
            vec![self.empty_block(k)],
            Instant::now() + within,
        );
        self.report(t)
    }

    /// Store `keys`' payloads of `len` bytes in one task; the report.
    pub fn store_keys(&self, keys: &[BlockKey], len: usize) -> TaskReport {
        self.run(Direction::Store, self.filled(keys, len))
    }

    /// Store `keys`' payloads, a whole buffer each; panics unless every block landed.
    pub fn store_ok(&self, keys: &[BlockKey]) {
        let r = self.store_keys(keys, self.pool.buf_size());
        assert!(r.is_ok(), "store failed: {:?}", first_error(&r));
    }

    /// Load `keys` in one task; the report.
    pub fn load(&self, keys: &[BlockKey]) -> TaskReport {
        self.run(Direction::Load, self.empty(keys))
    }

    /// Load `keys` and check each comes back whole with the payload [`Rig::store_keys`] wrote
    /// for it at its length in `lens`; `what` names the case in messages.
    pub fn assert_loads_back(
        &self,
        keys: &[BlockKey],
        lens: &[usize],
        what: impl std::fmt::Display,
    ) {
        let rep = self.load(keys);
        assert!(rep.is_ok(), "{what}: {:?}", rep.state);
        for ((b, k), len) in rep.blocks.iter().zip(keys).zip(lens) {
            let got = b.buf.as_ref().map(|b| b.as_slice().to_vec());
            assert_eq!(got, Some(expected(*k, *len)), "{what}: {k}");
        }
    }

    /// Wait until the store has nothing in flight (loads, stores, removes) and the driver no
    /// zombie op.
    pub fn drained(&self) -> bool {
        wait_until(SOON, || {
            let e = self.files.stats();
            let (s, _) = self.driver.stats().expect("driver running");
            e.in_flight == 0 && e.maintenance == 0 && s.zombie_ops == 0
        })
    }

    /// Tracker counters.
    pub fn tracker(&self) -> TrackerStats {
        self.driver.stats().expect("driver running").0
    }

    /// The store's spare folder under its first root.
    pub fn spare_dir(&self) -> PathBuf {
        self.root.join(crate::spare::SPARE_DIR)
    }
}
