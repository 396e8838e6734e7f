//! Tests that need faults injected around the real engines (no FUSE): the store in a driver on
//! a real directory, for both engines (issue 11's faults; a recycled block file held back from
//! the spares while a load of its block is in flight). The FUSE tests in `tests/acceptance` cover the same
//! faults on a really frozen mount.

/// One `#[test]` per engine for each named `fn(IoEngine)`.
macro_rules! both_engines {
    ($($name:ident),* $(,)?) => {
        mod uring {
            $(#[test] fn $name() { super::$name(crate::IoEngine::Uring) })*
        }
        mod psync {
            $(#[test] fn $name() { super::$name(crate::IoEngine::Psync) })*
        }
    };
}

mod faults;
mod noop;
mod psync_pool;
mod recycle;
mod unused_spare;

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvx_core::*;

use crate::io::fault::Faults;
use crate::io::{EngineOverride, EngineSnapshot};
use crate::{IoEngine, PosixConfig, PosixHandle, PosixStore};

/// Bound for "happens promptly" (never a performance assertion).
const SOON: Duration = Duration::from_secs(20);

fn key(i: u64) -> BlockKey {
    BlockKey::chain(None, &i.to_le_bytes())
}

/// A store with faults, in a driver, on a fresh directory.
struct FaultRig {
    driver: Driver,
    posix: BackendId,
    files: PosixHandle,
    pool: BufferPool,
    faults: Arc<Faults>,
    dir: tempfile::TempDir,
}

impl FaultRig {
    fn new(engine: IoEngine, bufs: usize, tune: impl FnOnce(&mut PosixConfig)) -> FaultRig {
        FaultRig::with_dir(engine, bufs, tempfile::tempdir().expect("temp dir"), tune)
    }

    fn with_dir(
        engine: IoEngine,
        bufs: usize,
        dir: tempfile::TempDir,
        tune: impl FnOnce(&mut PosixConfig),
    ) -> FaultRig {
        let faults = Arc::new(Faults::default());
        FaultRig::open(
            engine,
            bufs,
            dir,
            EngineOverride::with_faults(faults.clone()),
            faults,
            tune,
        )
    }

    /// A store running the noop engine, in a driver, on a fresh directory.
    fn noop(bufs: usize) -> FaultRig {
        let dir = tempfile::tempdir().expect("temp dir");
        let over = EngineOverride {
            faults: None,
            noop: true,
        };
        FaultRig::open(IoEngine::Psync, bufs, dir, over, Arc::default(), |_| {})
    }

    fn open(
        engine: IoEngine,
        bufs: usize,
        dir: tempfile::TempDir,
        over: EngineOverride,
        faults: Arc<Faults>,
        tune: impl FnOnce(&mut PosixConfig),
    ) -> FaultRig {
        let mut cfg = PosixConfig::new(dir.path());
        cfg.engine = engine;
        tune(&mut cfg);
        let store = PosixStore::open_with(cfg, over).expect("open store");
        let files = store.handle();
        let mut b = DriverBuilder::new(DriverConfig::default());
        let posix = b.backend(Box::new(store));
        FaultRig {
            driver: b.spawn().expect("driver"),
            posix,
            files,
            pool: BufferPool::new(bufs, 8192, DEFAULT_ALIGN).expect("pool"),
            faults,
            dir,
        }
    }

    /// A store with `spares` spare files made at open and none topped up; panics unless the
    /// temporary directory is on a local block file system (spares live only there).
    fn with_spares(
        engine: IoEngine,
        spares: usize,
        tune: impl FnOnce(&mut PosixConfig),
    ) -> FaultRig {
        let r = FaultRig::new(engine, 8, |c| {
            c.spare_files = spares;
            c.spare_refill = false;
            tune(c);
        });
        assert_eq!(
            r.files.spare_files_ready(),
            vec![spares],
            "this test needs its temporary directory on a local block file system"
        );
        r
    }

    /// The store's spare folder.
    fn spare_dir(&self) -> std::path::PathBuf {
        self.dir.path().join(crate::spare::SPARE_DIR)
    }

    fn engine(&self) -> EngineSnapshot {
        self.files.engine_snapshot()
    }

    fn block(&self, k: BlockKey, fill: u8) -> OpBlock {
        let mut buf = self.pool.take().expect("a free buffer");
        buf.set_len(8192);
        buf.as_mut_slice().fill(fill);
        OpBlock {
            key: k,
            engine: None,
            buf: Buf::Owned(buf),
        }
    }

    fn empty(&self, k: BlockKey) -> OpBlock {
        OpBlock {
            key: k,
            engine: None,
            buf: Buf::Owned(self.pool.take().expect("a free buffer")),
        }
    }

    fn submit(&self, dir: Direction, blocks: Vec<OpBlock>, deadline: Instant) -> TaskId {
        self.driver
            .submit(TaskSpec {
                request: RequestId(1),
                dir,
                route: vec![self.posix],
                blocks,
                deadline,
                deferred: false,
            })
            .expect("driver running")
    }

    fn report(&self, t: TaskId) -> TaskReport {
        self.driver
            .wait_report(t, Instant::now() + SOON)
            .unwrap_or_else(|| panic!("no report for {t}"))
    }

    /// Store `k` filled with `fill`; the report.
    fn store(&self, k: BlockKey, fill: u8, within: Duration) -> TaskReport {
        let t = self.submit(
            Direction::Store,
            vec![self.block(k, fill)],
            Instant::now() + within,
        );
        self.report(t)
    }

    /// Load `k`; the report.
    fn load(&self, k: BlockKey, within: Duration) -> TaskReport {
        let t = self.submit(
            Direction::Load,
            vec![self.empty(k)],
            Instant::now() + within,
        );
        self.report(t)
    }

    /// Wait until the engine has nothing in flight and the driver no zombie op.
    fn drained(&self) -> bool {
        wait_until(SOON, || {
            let e = self.engine();
            let (s, _) = self.driver.stats().expect("driver running");
            e.in_flight == 0 && e.maintenance == 0 && s.zombie_ops == 0
        })
    }
}

fn wait_until(within: Duration, mut cond: impl FnMut() -> bool) -> bool {
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
