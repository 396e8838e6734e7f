//! The test rig: a store on a FUSE mount (or a real directory), a driver with the store and a
//! host backend over a host arena, a staging pool, and helpers to run tasks with deadlines.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kvx_core::*;
use kvx_fusefs::{Backing, StallFs, StallMount};
use kvx_posix::{IoEngine, PosixConfig, PosixHandle, PosixStore};

/// Deadline of the tasks that hit a frozen mount.
pub const DEADLINE: Duration = Duration::from_millis(200);
/// The stated allowance on top of a tick for scheduling on these 2-core machines.
pub const ALLOWANCE: Duration = Duration::from_millis(50);
/// How far past its deadline the tracker may decide a task: one tick plus the allowance.
pub const MARGIN: Duration = TICK.saturating_add(ALLOWANCE);
/// Generous bound for "happens promptly" (never a performance assertion).
pub const SOON: Duration = Duration::from_secs(10);

/// Where the store lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Place {
    /// A FUSE mount (memory backing) that the test can freeze.
    Fuse,
    /// A directory on the real disk.
    Disk,
}

/// Key `i` of a test.
pub fn key(i: u64) -> BlockKey {
    BlockKey::chain(None, &i.to_le_bytes())
}

/// The payload the tests store under `k`.
pub fn expected(k: BlockKey, len: usize) -> Vec<u8> {
    let seed = k.to_be_bytes();
    (0..len)
        .map(|i| seed[i % 16].wrapping_add((i / 16) as u8))
        .collect()
}

/// Fill `buf` with `k`'s payload.
pub fn fill(buf: &mut PoolBuf, k: BlockKey, len: usize) {
    buf.set_len(len);
    buf.as_mut_slice().copy_from_slice(&expected(k, len));
}

/// Poll `cond` until it holds or `within` passes.
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

/// A store in a driver, with a host tier. Fields drop in order: the driver (and the store in
/// it) first, then the arena it copies into, then the mount (aborting anything still stuck),
/// then the directories.
pub struct Rig {
    pub driver: Driver,
    pub posix: BackendId,
    pub host: BackendId,
    pub files: PosixHandle,
    pub pool: BufferPool,
    pub arena: HostArena,
    pub root: PathBuf,
    pub mount: Option<StallMount>,
    pub _dir: tempfile::TempDir,
}

/// Size of a block in the rig's pool and arena.
pub const BLOCK: usize = 64 << 10;

impl Rig {
    /// A rig for `engine` at `place`; `tune` adjusts the store's settings.
    pub fn new(engine: IoEngine, place: Place, tune: impl FnOnce(&mut PosixConfig)) -> Rig {
        Rig::with_pool(engine, place, 160, tune)
    }

    /// Same, with `bufs` staging buffers.
    pub fn with_pool(
        engine: IoEngine,
        place: Place,
        bufs: usize,
        tune: impl FnOnce(&mut PosixConfig),
    ) -> Rig {
        let (dir, mount, root) = match place {
            Place::Fuse => {
                let dir = tempfile::tempdir().expect("temp dir");
                let mount = StallFs::mount(dir.path(), Backing::Memory).expect("FUSE mount");
                let root = mount.path().join("kv");
                (dir, Some(mount), root)
            }
            Place::Disk => {
                let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("temp dir");
                let root = dir.path().join("kv");
                (dir, None, root)
            }
        };
        let mut cfg = PosixConfig::new(&root);
        cfg.engine = engine;
        cfg.queue_depth = 64;
        tune(&mut cfg);
        let store = PosixStore::open(cfg).expect("open store");
        let files = store.handle();
        let arena = HostArena::contiguous(BLOCK, 64).expect("arena");
        let mut b = DriverBuilder::new(DriverConfig::default());
        let posix = b.backend(Box::new(store));
        // SAFETY: the arena is a field of the rig declared after the driver, so it outlives the
        // driver and its host backend; tests touch arena blocks only when no task names them.
        let host = b.backend(Box::new(unsafe {
            HostBackend::new(arena.layout().clone(), HostBackendConfig::default())
                .expect("host backend")
        }));
        Rig {
            driver: b.spawn().expect("driver"),
            posix,
            host,
            files,
            pool: BufferPool::new(bufs, BLOCK, DEFAULT_ALIGN).expect("pool"),
            arena,
            root,
            mount,
            _dir: dir,
        }
    }

    /// The FUSE mount (panics for a disk rig).
    pub fn mount(&self) -> &StallMount {
        self.mount.as_ref().expect("a FUSE rig")
    }

    /// Submit one task.
    pub fn submit(
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

    /// Blocks holding `keys`' payloads, in staging buffers.
    pub fn filled(&self, keys: &[BlockKey]) -> Vec<OpBlock> {
        keys.iter()
            .map(|&k| {
                let mut buf = self.pool.take().expect("a free staging buffer");
                fill(&mut buf, k, BLOCK);
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
        keys.iter()
            .map(|&k| OpBlock {
                key: k,
                engine: None,
                buf: Buf::Owned(self.pool.take().expect("a free staging buffer")),
            })
            .collect()
    }

    /// Store `keys` with a generous deadline; panics unless every block landed.
    pub fn store_ok(&self, keys: &[BlockKey]) {
        let t = self.submit(
            Direction::Store,
            vec![self.posix],
            self.filled(keys),
            Instant::now() + SOON,
        );
        let r = self.report(t, Instant::now() + SOON);
        assert!(r.is_ok(), "store failed: {:?}", first_error(&r));
    }

    /// Load `keys` into staging buffers with a generous deadline.
    pub fn load(&self, keys: &[BlockKey]) -> TaskReport {
        let t = self.submit(
            Direction::Load,
            vec![self.posix],
            self.empty(keys),
            Instant::now() + SOON,
        );
        self.report(t, Instant::now() + SOON)
    }

    /// Wait for a task's report; panics if none comes by `until`.
    pub fn report(&self, t: TaskId, until: Instant) -> TaskReport {
        self.driver
            .wait_report(t, until)
            .unwrap_or_else(|| panic!("no report for {t} in time"))
    }

    /// Wait until the driver has no zombie op and the store no I/O in flight.
    pub fn drained(&self) -> bool {
        wait_until(SOON, || {
            let (s, _) = self.driver.stats().expect("driver running");
            s.zombie_ops == 0 && self.files.stats().in_flight == 0
        })
    }

    /// Tracker counters.
    pub fn tracker(&self) -> TrackerStats {
        self.driver.stats().expect("driver running").0
    }
}

/// The first failed block's error of a report, for messages.
pub fn first_error(r: &TaskReport) -> Option<BlockError> {
    r.blocks.iter().find_map(|b| b.result.clone().err())
}

/// Assert that `r` timed out by its deadline plus [`MARGIN`]; returns how long after its
/// deadline it ended, for the log.
pub fn assert_timed_out_on_time(r: &TaskReport, deadline: Instant) -> Duration {
    assert_eq!(
        r.state,
        TaskState::TimedOut,
        "task {} should time out",
        r.task
    );
    assert!(
        r.finished_at <= deadline + MARGIN,
        "task {} ended {:?} after its deadline",
        r.task,
        r.finished_at.saturating_duration_since(deadline)
    );
    r.finished_at.saturating_duration_since(deadline)
}
