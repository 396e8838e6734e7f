//! kvx-rdma over loopback TCP: one load task of 16 MiB-ish through the importer, per block size
//! (64 KiB, 1 MiB, 4 MiB), next to a raw socket copy of the same bytes from the same engine
//! memory measured in the same run.

use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kvx_rdma::bench::LoopbackRig;

/// Blocks per task for each block size: 16 MiB per task for the larger blocks.
const CASES: [(usize, usize); 3] = [(64 << 10, 64), (1 << 20, 16), (4 << 20, 4)];

fn remote(c: &mut Criterion) {
    let mut g = c.benchmark_group("rdma_tcp_loopback");
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3));
    for (bs, task_blocks) in CASES {
        let blocks = (task_blocks * 4) as u32;
        let rig = LoopbackRig::new(bs, blocks, task_blocks, 1).expect("loopback rig");
        let label = format!("{}KiB", bs >> 10);
        g.throughput(Throughput::Bytes((bs * task_blocks) as u64));
        let mut next = 0usize;
        g.bench_function(BenchmarkId::new("kvx_read_task", &label), |b| {
            b.iter(|| {
                rig.read_task(next, task_blocks).expect("read task");
                next = (next + task_blocks) % rig.blocks();
            })
        });
        // The raw copy moves every exported block (4 tasks' worth) per iteration; only its
        // timed pass counts (it warms its connection up first, untimed).
        g.throughput(Throughput::Bytes((bs * blocks as usize) as u64));
        let mut raw = rig.raw_tcp_copy(1).expect("raw copy");
        g.bench_function(BenchmarkId::new("raw_tcp_copy", &label), |b| {
            b.iter_custom(|iters| (0..iters).map(|_| raw.measure().expect("raw copy")).sum())
        });
    }
    g.finish();
}

criterion_group!(benches, remote);
criterion_main!(benches);
