//! CUDA backend throughput next to a plain `cuMemcpyHtoD`/`DtoH` of the same bytes: 32
//! contiguous 2 MiB blocks and 1,024 scattered 64 KiB blocks, both directions. Compare the
//! `kvx` and `plain` lines of each group (same bytes, same run). Without CUDA it prints one
//! skip line and returns.

use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput};
use kvx_core::Direction;
use kvx_cuda::bench::{Case, Rig};
use kvx_cuda::{CudaBackendConfig, CudaDevice, CudaError};

fn bench_case(c: &mut Criterion, rig: &mut Rig, case: Case) -> Result<(), CudaError> {
    let mut group = c.benchmark_group(format!("cuda/{}", case.label()));
    group.throughput(Throughput::Bytes(rig.bytes()));
    group.sample_size(20);
    let mut failure = None;
    for (dir, name) in [(Direction::Load, "h2d"), (Direction::Store, "d2h")] {
        group.bench_function(BenchmarkId::new("kvx", name), |b| {
            b.iter_custom(|n| {
                let mut total = Duration::ZERO;
                for _ in 0..n {
                    match rig.kvx(dir) {
                        Ok(d) => total += d,
                        Err(e) => failure = Some(e),
                    }
                }
                total
            })
        });
        group.bench_function(BenchmarkId::new("plain", name), |b| {
            b.iter_custom(|n| {
                let mut total = Duration::ZERO;
                for _ in 0..n {
                    match rig.plain(dir) {
                        Ok(d) => total += d,
                        Err(e) => failure = Some(e),
                    }
                }
                total
            })
        });
    }
    group.finish();
    failure.map_or(Ok(()), Err)
}

fn main() {
    let device = match CudaDevice::open(0) {
        Ok(d) => d,
        Err(e) => {
            println!("skip: cuda benchmark: {e}");
            return;
        }
    };
    let mut c = Criterion::default().configure_from_args();
    for case in [Case::Contiguous, Case::Scattered] {
        let result = Rig::new(&device, case, CudaBackendConfig::default())
            .and_then(|mut rig| bench_case(&mut c, &mut rig, case));
        if let Err(e) = result {
            eprintln!("cuda benchmark {}: {e}", case.label());
            std::process::exit(1);
        }
    }
    c.final_summary();
}
