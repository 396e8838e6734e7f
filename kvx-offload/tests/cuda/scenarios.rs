//! A connector scenario for engine memory on a CUDA device only: a frozen file tier must not
//! write into device blocks after their verdict. (The scenarios shared with host memory are in
//! `common/scenarios.rs`.)

use std::time::{Duration, Instant};

use kvx_core::{EngineBlockId, RequestId};
use kvx_fusefs::{Backing, StallFs};
use kvx_offload::{Tier, WorkerOutput};
use kvx_policy::{LoadDecision, LoadFailurePolicy};
use libtest_mimic::Failed;

use crate::common::scenarios::seq;
use crate::common::{BLOCK, BT, EngineBlocks, Opts, keys};
use crate::engine::{Gpu, cuda_rig};

const T: Duration = Duration::from_secs(10);

/// The file tier freezes: a load of file blocks into the device gets its verdict (recompute)
/// by the deadline; the engine reuses the target blocks, and after the thaw the late file
/// reads never reach them; then the tier serves byte-exact again.
pub fn frozen_file_tier(gpu: &Gpu) -> Result<(), Failed> {
    let dir = tempfile::tempdir()?;
    let mount = StallFs::mount(dir.path(), Backing::Memory)?;
    let opts = || Opts {
        host_blocks: 8,
        load_ms: 250,
        store_ms: 250,
        policy: LoadFailurePolicy::Recompute,
        ..Opts::default()
    };
    let (a, b) = (keys(20, 2, 0, 0), keys(21, 2, 0, 0));
    {
        let mut r = cuda_rig(mount.path(), opts(), gpu)?;
        assert!(r.offload(1, &a, &[0, 1], T));
        assert!(r.offload(2, &b, &[2, 3], T));
    }
    let mut r = cuda_rig(mount.path(), opts(), gpu)?;
    assert_eq!(r.sched.manager().blocks(Tier::File), 4);
    mount.freeze();
    let target = seq(2, 10);
    assert_eq!(r.load(3, &a, &target), Some(2 * BT as u64));
    let t0 = Instant::now();
    assert!(r.step_until(T, |r| r.out.finished_recving.contains(&RequestId(3))));
    assert!(
        t0.elapsed() < Duration::from_secs(2),
        "the verdict took {:?}",
        t0.elapsed()
    );
    assert!(matches!(
        r.out.decisions.iter().find(|d| d.0 == RequestId(3)),
        Some((
            _,
            LoadDecision::Recompute {
                first_invalid_index: 0,
                ..
            }
        ))
    ));
    // The engine recomputes into the blocks (here: marks them), then the tier thaws.
    r.scribble(&target);
    r.finish(3);
    mount.thaw();
    assert!(r.settle(T), "did not settle after the thaw");
    for &t in &target {
        assert_eq!(
            r.arena.read_block(EngineBlockId(t))?,
            vec![0x5A; BLOCK],
            "a late file read reached device block {t} after its verdict"
        );
    }
    r.out = WorkerOutput::default();
    let fresh = seq(2, 30);
    r.scribble(&fresh);
    assert_eq!(r.load(4, &b, &fresh), Some(2 * BT as u64));
    assert!(r.step_until(T, |r| r.out.finished_recving.contains(&RequestId(4))));
    assert!(r.out.invalid_blocks.is_empty(), "{:?}", r.out);
    assert!(
        r.holds(&b, &fresh),
        "after the thaw the tier serves byte-exact"
    );
    r.finish(4);
    assert!(r.settle(T));
    Ok(())
}
