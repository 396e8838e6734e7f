//! `kvx bench <target>`: one module per backend.

mod cuda;

use clap::Subcommand;

/// Which backend to benchmark.
#[derive(Subcommand)]
pub enum BenchTarget {
    /// CUDA host<->device copies (contiguous and scattered blocks) next to a plain cuMemcpy.
    Cuda(cuda::CudaArgs),
}

/// Run a benchmark; returns the process exit code.
pub fn run(target: BenchTarget) -> i32 {
    match target {
        BenchTarget::Cuda(args) => cuda::run(args),
    }
}
