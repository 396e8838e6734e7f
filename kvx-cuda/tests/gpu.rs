//! GPU tests of the CUDA backend (libtest-mimic harness).
//!
//! The trials run on a GPU, or on the CPU stand-in for the driver (`kvx-cuda-standin`, which
//! `scripts/cuda-standin.sh` loads as `libcuda`; CI does): on the stand-in each trial gets a
//! device of its own, long copies are made long with its copy-delay knob instead of GiBs, and
//! the trials that need its other knobs run too (on a GPU they print a skip line).
//!
//! Where neither is present every GPU trial prints `skip: <trial>: <reason>` and counts as
//! ignored; set `KVX_CUDA_REQUIRE_GPU=1` (as `scripts/gpu-check.sh` and
//! `scripts/cuda-standin.sh` do) to make them fail instead. The no-CUDA trial runs everywhere.

#[path = "gpu/backend_trials.rs"]
mod backend_trials;
#[path = "gpu/driver_trials.rs"]
mod driver_trials;
#[path = "gpu/fixture.rs"]
mod fixture;
#[path = "gpu/order_trials.rs"]
mod order_trials;
#[path = "gpu/standin_trials.rs"]
mod standin_trials;

use backend_trials::{
    invalid_blocks_fail_alone, round_trip_cross_layer, round_trip_odd_per_run,
    round_trip_per_layer, wait_really_waits,
};
use driver_trials::{deadline_quarantine_on_long_copy, preempt_fence_flushes_inflight_store};
use fixture::{Gpu, ensure};
use kvx_cuda::{CudaDevice, CudaError, cuda_available};
use kvx_cuda_standin::control::Standin;
use libtest_mimic::{Arguments, Failed, Trial};
use order_trials::order_after_engine_stream;
use standin_trials::{
    driver_without_batch_copy, pinned_pool_in_chunks, sticky_error_fails_ops_not_the_process,
};

/// One mebibyte.
const MIB: usize = 1 << 20;

type GpuTest = fn(&Gpu) -> Result<(), Failed>;

fn main() {
    let args = Arguments::from_args();
    let require = std::env::var("KVX_CUDA_REQUIRE_GPU").is_ok_and(|v| v == "1");
    let gpu_tests: Vec<(&'static str, GpuTest)> = vec![
        (
            "round_trip_cross_layer_1000_blocks_batched",
            round_trip_cross_layer,
        ),
        ("round_trip_per_layer_batched", round_trip_per_layer),
        (
            "round_trip_per_layer_odd_sizes_per_run_copies",
            round_trip_odd_per_run,
        ),
        ("invalid_blocks_fail_alone", invalid_blocks_fail_alone),
        ("wait_really_waits", wait_really_waits),
        (
            "deadline_quarantine_on_long_copy",
            deadline_quarantine_on_long_copy,
        ),
        (
            "preempt_fence_flushes_inflight_store",
            preempt_fence_flushes_inflight_store,
        ),
        ("order_after_engine_stream", order_after_engine_stream),
    ];
    let standin_tests: Vec<(&'static str, GpuTest)> = vec![
        ("driver_without_batch_copy", driver_without_batch_copy),
        ("pinned_pool_in_chunks", pinned_pool_in_chunks),
        (
            "sticky_error_fails_ops_not_the_process",
            sticky_error_fails_ops_not_the_process,
        ),
    ];
    let mut trials = vec![Trial::test(
        "open_without_cuda_is_an_error_not_a_panic",
        no_cuda_is_an_error,
    )];
    match CudaDevice::open(0) {
        Ok(dev) => {
            let standin = Standin::loaded();
            println!(
                "kvx-cuda GPU tests on {} (driver {}, cuMemcpyBatchAsync {})",
                dev.name(),
                dev.driver_version(),
                if dev.batch_copy_available() {
                    "available"
                } else {
                    "absent: per-run copies"
                }
            );
            let knob_tests = match standin {
                Some(_) => standin_tests,
                None => {
                    skip(
                        &mut trials,
                        &standin_tests,
                        "needs the CUDA stand-in's knobs",
                    );
                    Vec::new()
                }
            };
            for (i, (name, f)) in gpu_tests.into_iter().chain(knob_tests).enumerate() {
                // On the stand-in, trial i runs on device i + 1 (its knobs are its own).
                let gpu = match standin {
                    None => Ok(dev.clone()),
                    Some(_) => CudaDevice::open(i as u32 + 1),
                }
                .map(|dev| Gpu { dev, standin });
                trials.push(Trial::test(name, move || f(&gpu?)));
            }
        }
        Err(e) if e.is_unavailable() && !require => {
            let all: Vec<_> = gpu_tests.into_iter().chain(standin_tests).collect();
            skip(&mut trials, &all, &e.to_string());
        }
        Err(e) => {
            for (name, _) in gpu_tests.into_iter().chain(standin_tests) {
                let msg =
                    format!("a GPU is required (KVX_CUDA_REQUIRE_GPU=1) but CUDA is unusable: {e}");
                trials.push(Trial::test(name, move || Err(msg.into())));
            }
        }
    }
    libtest_mimic::run(&args, trials).exit();
}

/// One `skip:` line and an ignored trial for each of `tests`.
fn skip(trials: &mut Vec<Trial>, tests: &[(&'static str, GpuTest)], reason: &str) {
    for (name, _) in tests {
        println!("skip: {name}: {reason}");
        trials.push(Trial::test(*name, || Ok(())).with_ignored_flag(true));
    }
}

/// Runs everywhere: without libcuda, `open` is `NoCuda` (no panic); with it, a missing device
/// ordinal is `NoDevice`.
fn no_cuda_is_an_error() -> Result<(), Failed> {
    let opened = std::panic::catch_unwind(|| CudaDevice::open(0));
    let Ok(opened) = opened else {
        return Err("CudaDevice::open panicked".into());
    };
    match opened {
        Err(e) if !cuda_available() => {
            ensure!(
                matches!(e, CudaError::NoCuda { .. }),
                "without libcuda, open must say NoCuda, got: {e}"
            );
            ensure!(
                e.is_unavailable() && e.to_string().starts_with("no CUDA"),
                "unclear message: {e}"
            );
        }
        Err(e) => ensure!(
            e.is_unavailable() || matches!(e, CudaError::Driver { .. }),
            "unexpected error with libcuda present: {e}"
        ),
        Ok(dev) => {
            ensure!(
                cuda_available(),
                "opened a device although the library probe failed"
            );
            match CudaDevice::open(4096) {
                Err(CudaError::NoDevice { ordinal: 4096, .. }) => {}
                other => {
                    return Err(format!("device 4096 should be NoDevice, got {other:?}").into());
                }
            }
            println!(
                "CUDA present ({}); the no-library branch is covered by a unit test",
                dev.name()
            );
        }
    }
    Ok(())
}
