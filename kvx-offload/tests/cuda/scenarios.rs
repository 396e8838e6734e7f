//! The connector's host-tier scenarios with engine memory on a CUDA device: preemption flush
//! then reload, the block-reuse fence, load failure → recompute, a frozen file tier, reset.
//! Every engine block is checked byte-exact on the "device".

use std::time::{Duration, Instant};

use kvx_core::{BlockKey, EngineBlockId, RequestId};
use kvx_fusefs::{Backing, StallFs};
use kvx_offload::{JobPart, Tier, WorkerOutput};
use kvx_policy::{LoadDecision, LoadFailurePolicy};
use libtest_mimic::Failed;

use crate::common::{BLOCK, BT, EngineBlocks, Opts, keys};
use crate::engine::{Gpu, cuda_rig};

const T: Duration = Duration::from_secs(10);

fn seq(n: u32, from: u32) -> Vec<u32> {
    (from..from + n).collect()
}

/// A store of device blocks is in flight when the request is preempted: the fence holds only
/// once the device→host copies completed; the blocks, reused, reload byte-exact.
pub fn preempt_flush_then_reload(gpu: &Gpu) -> Result<(), Failed> {
    let dir = tempfile::tempdir()?;
    let mut r = cuda_rig(dir.path(), Opts::default(), gpu, Duration::from_millis(40))?;
    let ks = keys(1, 0, 1, 4);
    let blocks = seq(4, 0);
    r.compute(&ks, &blocks);
    r.save(1, &ks, &blocks).ok_or("no store job")?;
    r.step(); // the store is queued (deferred to the next step)
    r.sched.request_preempted(RequestId(1));
    r.step(); // submits the queued store, flushes it, and hands back the fence
    let fence = r
        .fences
        .pop()
        .ok_or("the 40 ms device copies already ended")?;
    assert_eq!(fence.requests(), &[RequestId(1)]);
    assert!(!fence.is_ready());
    assert!(fence.wait(Instant::now() + T), "the fence never held");
    r.step();
    let host_done: usize = r
        .out
        .jobs
        .iter()
        .filter(|j| j.part == JobPart::StoreHost)
        .map(|j| j.ok.len())
        .sum();
    assert_eq!(
        host_done, 4,
        "the fence held only after the copies completed"
    );
    r.scribble(&blocks); // the engine reuses the preempted request's blocks
    let again = seq(4, 20);
    assert_eq!(r.load(1, &ks, &again), Some(4 * BT as u64));
    assert!(r.step_until(T, |r| r.out.finished_recving.contains(&RequestId(1))));
    assert!(r.out.invalid_blocks.is_empty());
    assert!(
        r.holds(&ks, &again),
        "reloaded device blocks are byte-exact"
    );
    r.finish(1);
    assert!(r.settle(T));
    Ok(())
}

/// Block 7 is being stored when its request finishes and the engine hands it to another
/// request as a load target: the load lands only after the store read the block.
pub fn reuse_fence(gpu: &Gpu) -> Result<(), Failed> {
    let dir = tempfile::tempdir()?;
    let mut r = cuda_rig(dir.path(), Opts::default(), gpu, Duration::from_millis(60))?;
    let b_keys = keys(3, 0, 3, 1);
    r.compute(&b_keys, &[40]);
    r.save(2, &b_keys, &[40]);
    assert!(r.step_until(T, |r| r.sched.manager().is_stored(Tier::Host, b_keys[0])));
    let a_keys = keys(4, 0, 4, 1);
    r.compute(&a_keys, &[7]);
    r.save(1, &a_keys, &[7]);
    r.step();
    assert!(r.finish(1), "store in flight: freeing must wait");
    assert_eq!(r.load(2, &b_keys, &[7]), Some(BT as u64));
    assert!(r.step_until(T, |r| r.out.finished_recving.contains(&RequestId(2))));
    assert!(
        r.holds(&b_keys, &[7]),
        "the load landed after the store read block 7"
    );
    r.scribble(&[50]);
    assert_eq!(r.load(3, &a_keys, &[50]), Some(BT as u64));
    assert!(r.step_until(T, |r| r.out.finished_recving.contains(&RequestId(3))));
    assert!(
        r.holds(&a_keys, &[50]),
        "request 1's stored bytes are its own"
    );
    r.finish(2);
    r.finish(3);
    assert!(r.settle(T));
    Ok(())
}

/// A corrupt block file: the load into device blocks reports the blocks from it on as invalid
/// (recompute), and the blocks before it are byte-exact on the device.
pub fn load_failure_recompute(gpu: &Gpu) -> Result<(), Failed> {
    let dir = tempfile::tempdir()?;
    let ks = keys(8, 8, 0, 0);
    {
        let mut r = cuda_rig(dir.path(), Opts::default(), gpu, Duration::ZERO)?;
        assert!(r.offload(1, &ks, &seq(8, 0), T));
    }
    let mut r = cuda_rig(dir.path(), Opts::default(), gpu, Duration::ZERO)?;
    let path = r.files.block_path(ks[3]);
    let mut bytes = std::fs::read(&path)?;
    let last = bytes.len() - 1;
    bytes[last] ^= 0xFF;
    std::fs::write(&path, bytes)?;
    assert_eq!(r.load(9, &ks, &seq(8, 10)), Some(8 * BT as u64));
    assert!(r.step_until(T, |r| r.out.finished_recving.contains(&RequestId(9))));
    let invalid: Vec<EngineBlockId> = (13..18).map(EngineBlockId).collect();
    assert_eq!(
        r.out.decisions,
        vec![(
            RequestId(9),
            LoadDecision::Recompute {
                first_invalid_index: 3,
                valid_tokens: 3 * BT as u64,
                invalid: invalid.clone()
            }
        )]
    );
    assert_eq!(r.out.invalid_blocks, invalid);
    assert!(
        r.holds(&ks[..3], &seq(3, 10)),
        "blocks before the bad one are valid"
    );
    r.finish(9);
    assert!(r.settle(T));
    Ok(())
}

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
        let mut r = cuda_rig(mount.path(), opts(), gpu, Duration::ZERO)?;
        assert!(r.offload(1, &a, &[0, 1], T));
        assert!(r.offload(2, &b, &[2, 3], T));
    }
    let mut r = cuda_rig(mount.path(), opts(), gpu, Duration::ZERO)?;
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

/// Reset with device→host stores in flight: the reset's fence holds, their late completions
/// change nothing, and new work runs normally.
pub fn reset_drops_stale(gpu: &Gpu) -> Result<(), Failed> {
    let dir = tempfile::tempdir()?;
    let mut r = cuda_rig(dir.path(), Opts::default(), gpu, Duration::from_millis(50))?;
    let ks = keys(10, 0, 10, 4);
    r.compute(&ks, &seq(4, 0));
    r.save(1, &ks, &seq(4, 0));
    r.step();
    r.step(); // stores in flight (slow device copies)
    let reset = r.w().reset()?;
    assert!(
        reset.fence.wait(Instant::now() + T),
        "the reset's fence holds"
    );
    r.sched.reset();
    r.out = WorkerOutput::default();
    std::thread::sleep(Duration::from_millis(150));
    r.step();
    r.step();
    assert!(
        r.out.jobs.is_empty(),
        "late completions of old jobs change nothing"
    );
    assert_eq!(r.sched.manager().lookup(&ks).blocks(), 0);
    assert_eq!(r.w().host_blocks(), 0);
    let ks2: Vec<BlockKey> = keys(11, 0, 11, 2);
    assert!(r.offload(2, &ks2, &[8, 9], T));
    assert_eq!(r.sched.manager().lookup(&ks2).blocks(), 2);
    r.scribble(&[8, 9]);
    assert_eq!(r.load(3, &ks2, &[8, 9]), Some(2 * BT as u64));
    assert!(r.step_until(T, |r| r.out.finished_recving.contains(&RequestId(3))));
    assert!(r.holds(&ks2, &[8, 9]), "new work is byte-exact");
    r.finish(3);
    assert!(r.settle(T));
    assert!(r.pool_whole());
    Ok(())
}
