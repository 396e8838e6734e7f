//! Connector scenarios written once for any engine memory: `tests/connector.rs` runs them on
//! host memory, `tests/cuda.rs` on a CUDA device. `make(dir, opts)` builds the rig; a rig
//! honours `opts.host_delay` as the time every engine copy takes (a slow engine).

use std::path::Path;
use std::time::{Duration, Instant};

use kvx_core::*;
use kvx_offload::*;
use kvx_policy::{LoadDecision, LoadFailurePolicy};

use super::{BT, EngineBlocks, Opts, Rig, keys};

const T: Duration = Duration::from_secs(10);

pub fn seq(n: u32, from: u32) -> Vec<u32> {
    (from..from + n).collect()
}

/// A store is in flight when its request is preempted: the fence holds only once the engine
/// copies completed; the blocks, reused, reload byte-exact.
pub fn preempt_flush_then_reload<M: EngineBlocks>(make: impl Fn(&Path, Opts) -> Rig<M>) {
    let dir = tempfile::tempdir().unwrap();
    let mut r = make(
        dir.path(),
        Opts {
            host_delay: Duration::from_millis(40),
            ..Opts::default()
        },
    );
    let ks = keys(1, 0, 1, 4);
    let blocks = seq(4, 0);
    r.compute(&ks, &blocks);
    r.save(1, &ks, &blocks).expect("a store job");
    r.step(); // the store is queued (deferred to the next step)
    r.sched.request_preempted(RequestId(1));
    r.step(); // submits the queued store, flushes it, and hands back the fence
    let fence = r.fences.pop().expect("the 40 ms store is still running");
    assert_eq!(fence.requests(), &[RequestId(1)]);
    assert!(!fence.is_ready());
    assert!(
        fence.wait(Instant::now() + T),
        "the fence holds once the store ran"
    );
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
        "the fence held only after the stores completed"
    );
    // The engine now reuses the preempted request's blocks.
    r.scribble(&blocks);
    // Rescheduled: everything loads from the tiers, nothing is recomputed.
    let again = seq(4, 20);
    assert_eq!(r.load(1, &ks, &again), Some(4 * BT as u64));
    assert!(r.step_until(T, |r| r.out.finished_recving.contains(&RequestId(1))));
    assert!(r.out.invalid_blocks.is_empty());
    assert!(r.holds(&ks, &again), "reloaded blocks are byte-exact");
    r.finish(1);
    assert!(r.settle(T));
}

/// Block 7 is being stored when its request finishes and the engine hands it to another
/// request as a load target: the load lands only after the store read the block.
pub fn reuse_fence<M: EngineBlocks>(make: impl Fn(&Path, Opts) -> Rig<M>) {
    let dir = tempfile::tempdir().unwrap();
    let mut r = make(
        dir.path(),
        Opts {
            host_delay: Duration::from_millis(60),
            ..Opts::default()
        },
    );
    // Request 2's blocks are offloaded first (its content is what block 7 must end up with).
    let b_keys = keys(3, 0, 3, 1);
    r.compute(&b_keys, &[40]);
    r.save(2, &b_keys, &[40]);
    assert!(
        r.step_until(T, |r| r.sched.manager().is_stored(Tier::Host, b_keys[0])),
        "request 2's block was stored"
    );
    // Request 1 computed block 7 and saves it; it finishes while the store is queued.
    let a_keys = keys(4, 0, 4, 1);
    r.compute(&a_keys, &[7]);
    r.save(1, &a_keys, &[7]);
    r.step();
    assert!(r.finish(1), "store in flight: freeing must wait");
    // The engine hands block 7 to request 2 as a load target right away.
    assert_eq!(r.load(2, &b_keys, &[7]), Some(BT as u64));
    assert!(r.step_until(T, |r| r.out.finished_recving.contains(&RequestId(2))));
    assert!(
        r.holds(&b_keys, &[7]),
        "the load landed after the store read block 7"
    );
    // Request 1's stored bytes are its own, not request 2's.
    r.scribble(&[50]);
    assert_eq!(r.load(3, &a_keys, &[50]), Some(BT as u64));
    assert!(r.step_until(T, |r| r.out.finished_recving.contains(&RequestId(3))));
    assert!(r.holds(&a_keys, &[50]));
    r.finish(2);
    r.finish(3);
    assert!(r.settle(T));
}

/// Offload 8 blocks, flip a byte of block 3's file, and load them into blocks 10..18 of a fresh
/// rig under `policy`; returns that rig once the load ended.
pub fn corrupt_third_block<M: EngineBlocks>(
    make: impl Fn(&Path, Opts) -> Rig<M>,
    policy: LoadFailurePolicy,
) -> (Rig<M>, tempfile::TempDir, Vec<BlockKey>) {
    let dir = tempfile::tempdir().unwrap();
    let ks = keys(8, 8, 0, 0);
    {
        let mut r = make(dir.path(), Opts::default());
        assert!(r.offload(1, &ks, &seq(8, 0), T));
    }
    // Flip one payload byte of block 3's file.
    let path = {
        let r = make(dir.path(), Opts::default());
        r.files.block_path(ks[3])
    };
    let mut bytes = std::fs::read(&path).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0xFF;
    std::fs::write(&path, bytes).unwrap();
    let mut r = make(
        dir.path(),
        Opts {
            policy,
            ..Opts::default()
        },
    );
    assert_eq!(r.load(9, &ks, &seq(8, 10)), Some(8 * BT as u64));
    assert!(r.step_until(T, |r| r.out.finished_recving.contains(&RequestId(9))));
    (r, dir, ks)
}

pub fn engine_ids(v: std::ops::Range<u32>) -> Vec<EngineBlockId> {
    v.map(EngineBlockId).collect()
}

/// A corrupt block file: the blocks from it on are invalid (recompute), the ones before it
/// byte-exact.
pub fn load_failure_recompute<M: EngineBlocks>(make: impl Fn(&Path, Opts) -> Rig<M>) {
    let (mut r, _d, ks) = corrupt_third_block(&make, LoadFailurePolicy::Recompute);
    let (req, d) = r.out.decisions[0].clone();
    assert_eq!(req, RequestId(9));
    assert_eq!(
        d,
        LoadDecision::Recompute {
            first_invalid_index: 3,
            valid_tokens: 3 * BT as u64,
            invalid: engine_ids(13..18)
        }
    );
    assert_eq!(r.out.invalid_blocks, engine_ids(13..18));
    assert!(
        r.holds(&ks[..3], &seq(3, 10)),
        "blocks before the bad one are valid"
    );
    assert!(
        !r.sched.manager().is_stored(Tier::File, ks[3]),
        "the corrupt block left the index"
    );
    r.finish(9);
    assert!(r.settle(T));
}

/// Reset with stores in flight: the reset's fence holds, their late completions change
/// nothing, and new work runs normally and byte-exact.
pub fn reset_drops_stale<M: EngineBlocks>(make: impl Fn(&Path, Opts) -> Rig<M>) {
    let dir = tempfile::tempdir().unwrap();
    let mut r = make(
        dir.path(),
        Opts {
            host_delay: Duration::from_millis(50),
            ..Opts::default()
        },
    );
    let ks = keys(10, 0, 10, 4);
    r.compute(&ks, &seq(4, 0));
    r.save(1, &ks, &seq(4, 0));
    r.step();
    r.step(); // stores in flight (slow engine copies)
    let reset = r.w().reset().unwrap();
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
    assert_eq!(
        r.sched.manager().lookup(&ks).blocks(),
        0,
        "nothing became visible"
    );
    assert_eq!(r.w().host_blocks(), 0);
    // New work runs normally.
    let ks2 = keys(11, 0, 11, 2);
    assert!(r.offload(2, &ks2, &[8, 9], T));
    assert_eq!(r.sched.manager().lookup(&ks2).blocks(), 2);
    r.scribble(&[8, 9]);
    assert_eq!(r.load(3, &ks2, &[8, 9]), Some(2 * BT as u64));
    assert!(r.step_until(T, |r| r.out.finished_recving.contains(&RequestId(3))));
    assert!(r.holds(&ks2, &[8, 9]), "new work is byte-exact");
    r.finish(3);
    assert!(r.settle(T));
    assert!(r.pool_whole());
}
