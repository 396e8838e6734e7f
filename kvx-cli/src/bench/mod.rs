//! `kvx bench <target>`: one module per backend.

pub(crate) mod core;
pub(crate) mod counting_alloc;
mod cuda;
mod pin;
mod posix;
mod remote;
mod remote_pd;

use clap::Subcommand;

/// Which backend to benchmark.
#[derive(Subcommand)]
pub enum BenchTarget {
    /// The kvx-core tracker alone: tasks per second, expiry cost among many in flight, and
    /// allocations per task.
    Core(core::CoreArgs),
    /// CUDA host<->device copies (contiguous and scattered blocks) next to a plain cuMemcpy.
    Cuda(cuda::CudaArgs),
    /// File block store: store then load blocks (kvx-posix), optionally next to fio.
    Posix(posix::PosixArgs),
    /// kvx-rdma remote reads over loopback TCP next to a raw socket copy of the same bytes.
    Remote(remote::RemoteArgs),
}

/// Run a benchmark; returns the process exit code.
pub fn run(target: BenchTarget) -> i32 {
    match target {
        BenchTarget::Core(args) => core::run(args),
        BenchTarget::Cuda(args) => cuda::run(args),
        BenchTarget::Posix(args) => posix::run(args),
        BenchTarget::Remote(args) => remote::run(args),
    }
}
