//! Tests that need faults injected around the real engines (no FUSE): the store in a driver on
//! a real directory ([`crate::testing::Rig`]), for both engines (issue 11's faults; a recycled
//! block file held back from the spares while a load of its block is in flight), and the noop
//! engine. The FUSE tests in `tests/acceptance` cover the same faults on a really frozen mount.

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
mod reorder;
mod unused_spare;

use crate::testing::{Rig, RigShape};
use crate::{IoEngine, PosixConfig};

/// Bytes of each staging buffer of these tests.
const BLOCK: usize = 8192;

/// A rig running `engine` on a fresh directory with `bufs` staging buffers.
fn rig(engine: IoEngine, bufs: usize, tune: impl FnOnce(&mut PosixConfig)) -> Rig {
    rig_in(engine, bufs, tempfile::tempdir().expect("temp dir"), tune)
}

/// A rig running `engine` on `dir` with `bufs` staging buffers.
fn rig_in(
    engine: IoEngine,
    bufs: usize,
    dir: tempfile::TempDir,
    tune: impl FnOnce(&mut PosixConfig),
) -> Rig {
    Rig::in_dir(dir, RigShape::new(bufs, BLOCK), |c| {
        c.io_engine = engine;
        tune(c);
    })
}

/// A rig with `spares` spare files made at open and none topped up; panics unless the
/// temporary directory is on a local block file system (spares live only there).
fn rig_with_spares(engine: IoEngine, spares: usize, tune: impl FnOnce(&mut PosixConfig)) -> Rig {
    let r = rig(engine, 8, |c| {
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
