//! The test rig: a store on a FUSE mount (or a real directory), a driver with the store and a
//! CPU backend over a host arena, a staging pool, and helpers to run tasks with deadlines.

use std::time::{Duration, Instant};

use kvx_core::*;
use kvx_fusefs::{Backing, StallFs, StallMount};
use kvx_posix::testing::{Rig as TestRig, RigShape};
pub use kvx_posix::testing::{SOON, expected, files_with_suffix, first_error, key, wait_until};
use kvx_posix::{IoEngine, PosixConfig};

/// Deadline of the tasks that hit a frozen mount.
pub const DEADLINE: Duration = Duration::from_millis(200);
/// The stated allowance on top of a tick for scheduling on these 2-core machines.
pub const ALLOWANCE: Duration = Duration::from_millis(50);
/// How far past its deadline the tracker may decide a task: one tick plus the allowance.
pub const MARGIN: Duration = TICK.saturating_add(ALLOWANCE);
/// Where the store lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Place {
    /// A FUSE mount (memory backing) that the test can freeze.
    Fuse,
    /// A directory on the real disk.
    Disk,
}

/// A store in a driver, with a host tier: kvx-posix's test rig ([`TestRig`]) at a [`Place`].
/// Fields drop in order: the rig (its driver, with the store, then the arena it copies into),
/// then the mount (aborting anything still stuck), then the directories.
pub struct Rig {
    pub rig: TestRig,
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
        cfg.io_engine = engine;
        cfg.queue_depth = 64;
        tune(&mut cfg);
        let shape = RigShape {
            host_blocks: 64,
            ..RigShape::new(bufs, BLOCK)
        };
        Rig {
            rig: TestRig::open(cfg, shape),
            mount,
            _dir: dir,
        }
    }

    /// The FUSE mount (panics for a disk rig).
    pub fn mount(&self) -> &StallMount {
        self.mount.as_ref().expect("a FUSE rig")
    }
}

impl std::ops::Deref for Rig {
    type Target = TestRig;
    fn deref(&self) -> &TestRig {
        &self.rig
    }
}

impl std::ops::DerefMut for Rig {
    fn deref_mut(&mut self) -> &mut TestRig {
        &mut self.rig
    }
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
