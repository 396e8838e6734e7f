//! The connector with engine memory on a CUDA device (`EngineMemory::cuda`): a round trip
//! through the host and file tiers, and the host-tier scenarios of `tests/connector.rs`
//! (preemption flush then reload, the reuse fence, load failure → recompute, a frozen file
//! tier, reset), byte-exact on the device. Run with `--features cuda`.
//!
//! They run on a GPU, or on the CPU stand-in for the CUDA driver (`scripts/cuda-standin.sh
//! cargo test -p kvx-offload --features cuda --test cuda`, as CI does), where each trial has a
//! device of its own and the engine copies are slowed with the stand-in's delay knob. The
//! scenarios that need slow copies to be conclusive run only there. The stores and loads
//! ordered after a forward still pending on the engine's stream (`cuda/order.rs`) run on both. Where neither is present
//! each trial prints one `skip:` line and counts as ignored (`KVX_CUDA_REQUIRE_GPU=1` makes
//! that a failure).

mod common;
#[path = "cuda/engine.rs"]
mod engine;
#[path = "cuda/export.rs"]
mod export;
#[path = "cuda/order.rs"]
mod order;
#[path = "cuda/scenarios.rs"]
mod scenarios;

use std::time::Duration;

use common::{BLOCK, BT, EngineBlocks, Opts};
use engine::{Gpu, cuda_rig};
use kvx_core::{BlockKey, EngineBlockId, RequestId};
use kvx_cuda::CudaDevice;
use kvx_cuda_standin::control::Standin;
use libtest_mimic::{Arguments, Failed, Trial};

/// A block stored to the host tier and the file tier loads back byte-exact into another
/// device block.
fn round_trip(gpu: &Gpu) -> Result<(), Failed> {
    let dir = tempfile::tempdir()?;
    let mut r = cuda_rig(dir.path(), Opts::default(), gpu)?;
    let data: Vec<u8> = (0..BLOCK).map(|i| (i * 7 % 251) as u8).collect();
    r.arena.write_block(EngineBlockId(3), &data)?;
    let key = BlockKey::chain(None, b"gpu block");
    r.sched
        .save_blocks(RequestId(1), &[(key, EngineBlockId(3))]);
    r.finish(1);
    if !r.settle(Duration::from_secs(10)) {
        return Err("the store did not settle".into());
    }
    if r.load(2, &[key], &[9]) != Some(u64::from(BT)) {
        return Err("the stored block is not found".into());
    }
    let done = r.step_until(Duration::from_secs(10), |r| {
        r.out.finished_recving.contains(&RequestId(2))
    });
    if !done || !r.out.invalid_blocks.is_empty() {
        return Err(format!("load did not finish cleanly: {:?}", r.out).into());
    }
    if r.arena.read_block(EngineBlockId(9))? != data {
        return Err("the loaded device block differs".into());
    }
    Ok(())
}

type CudaTest = fn(&Gpu) -> Result<(), Failed>;

/// The shared connector scenarios (`common/scenarios.rs`) on a rig over `gpu`.
fn preempt_flush_then_reload(gpu: &Gpu) -> Result<(), Failed> {
    common::scenarios::preempt_flush_then_reload(|d, o| cuda_rig(d, o, gpu).unwrap());
    Ok(())
}

fn reuse_fence(gpu: &Gpu) -> Result<(), Failed> {
    common::scenarios::reuse_fence(|d, o| cuda_rig(d, o, gpu).unwrap());
    Ok(())
}

fn load_failure_recompute(gpu: &Gpu) -> Result<(), Failed> {
    common::scenarios::load_failure_recompute(|d, o| cuda_rig(d, o, gpu).unwrap());
    Ok(())
}

fn reset_drops_stale(gpu: &Gpu) -> Result<(), Failed> {
    common::scenarios::reset_drops_stale(|d, o| cuda_rig(d, o, gpu).unwrap());
    Ok(())
}

fn main() {
    let args = Arguments::from_args();
    let require = std::env::var("KVX_CUDA_REQUIRE_GPU").is_ok_and(|v| v == "1");
    // (name, test, needs the stand-in's slow copies, needs FUSE)
    let tests: Vec<(&str, CudaTest, bool, bool)> = vec![
        ("cuda_round_trip", round_trip, false, false),
        (
            "cuda_preempt_flush_then_reload",
            preempt_flush_then_reload,
            true,
            false,
        ),
        ("cuda_reuse_fence", reuse_fence, false, false),
        (
            "cuda_load_failure_recompute",
            load_failure_recompute,
            false,
            false,
        ),
        (
            "cuda_frozen_file_tier",
            scenarios::frozen_file_tier,
            false,
            true,
        ),
        ("cuda_reset_drops_stale", reset_drops_stale, true, false),
        (
            "cuda_producer_stages_exports_in_host_buffers",
            export::gpu_producer_stages_exports_in_host_buffers,
            false,
            false,
        ),
        (
            "cuda_producer_copy_failure_refuses_the_export",
            export::gpu_producer_copy_failure_refuses_the_export,
            true,
            false,
        ),
        (
            "cuda_producer_reset_during_a_copy",
            export::gpu_producer_reset_during_a_copy,
            true,
            false,
        ),
        (
            "cuda_store_after_a_pending_forward",
            order::store_after_a_pending_forward,
            false,
            false,
        ),
        (
            "cuda_load_after_a_pending_forward",
            order::load_after_a_pending_forward,
            false,
            false,
        ),
    ];
    let fuse = kvx_fusefs::fuse_available();
    let opened = CudaDevice::open(0);
    let standin = opened.as_ref().ok().and_then(|_| Standin::loaded());
    let mut trials = Vec::new();
    for (i, (name, f, slow, needs_fuse)) in tests.into_iter().enumerate() {
        let why_not = match (&opened, &fuse) {
            (Err(e), _) if require => {
                let msg = format!("a GPU is required (KVX_CUDA_REQUIRE_GPU=1): {e}");
                trials.push(Trial::test(name, move || Err(msg.into())));
                continue;
            }
            (Err(e), _) => Some(e.to_string()),
            (Ok(_), _) if slow && standin.is_none() => {
                Some("needs the CUDA stand-in's slow copies to be conclusive".into())
            }
            (Ok(_), Err(why)) if needs_fuse => Some(format!("no FUSE: {why}")),
            (Ok(_), _) => None,
        };
        if let Some(why) = why_not {
            println!("skip: {name}: {why}");
            trials.push(Trial::test(name, || Ok(())).with_ignored_flag(true));
            continue;
        }
        // On the stand-in, trial i runs on device i + 1 (its knobs are its own).
        let gpu = match (&opened, standin) {
            (Ok(dev), None) => Ok(dev.clone()),
            (Ok(_), Some(_)) => CudaDevice::open(i as u32 + 1),
            (Err(e), _) => Err(e.clone()),
        }
        .map(|dev| Gpu { dev, standin });
        trials.push(Trial::test(name, move || f(&gpu?)));
    }
    libtest_mimic::run(&args, trials).exit();
}
