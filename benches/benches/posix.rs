//! kvx-posix store and load throughput: 256 KiB / 1 MiB / 4 MiB blocks at queue depth 1 / 8 /
//! 32, both engines, on a directory of the real disk (O_DIRECT where it takes it). Each
//! iteration moves 64 MiB. Compare with fio through `kvx bench posix --fio`.

use std::path::PathBuf;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kvx_core::Direction;
use kvx_posix::bench::{BenchRig, bench_keys};
use kvx_posix::{IoEngine, PosixConfig};

const PER_ITER: usize = 64 << 20;
/// Deadline of each benchmark op.
const DEADLINE: Duration = Duration::from_secs(30);

fn dir() -> PathBuf {
    let base = std::env::var_os("KVX_BENCH_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_TARGET_TMPDIR")));
    base.join(format!("kvx-posix-bench-{}", std::process::id()))
}

fn posix(c: &mut Criterion) {
    let root = dir();
    for dir_kind in [Direction::Store, Direction::Load] {
        let mut g = c.benchmark_group(format!("posix_{dir_kind}"));
        g.sample_size(10)
            .warm_up_time(Duration::from_millis(300))
            .measurement_time(Duration::from_secs(2));
        for engine in [IoEngine::Uring, IoEngine::Psync] {
            for size in [256 << 10, 1 << 20, 4 << 20] {
                for qd in [1usize, 8, 32] {
                    let mut cfg = PosixConfig::new(root.join(format!("{engine}-{size}")));
                    cfg.io_engine = engine;
                    cfg.queue_depth = qd;
                    let mut rig = BenchRig::new(cfg, size, qd).expect("open store");
                    let keys = bench_keys(size as u64, PER_ITER / size);
                    if dir_kind == Direction::Load {
                        assert!(
                            rig.run(Direction::Store, &keys, DEADLINE).is_clean(),
                            "fill"
                        );
                    }
                    g.throughput(Throughput::Bytes(PER_ITER as u64));
                    let id = BenchmarkId::new(format!("{engine}/{}KiB", size >> 10), qd);
                    g.bench_function(id, |b| {
                        b.iter_custom(|iters| {
                            let mut t = Duration::ZERO;
                            for _ in 0..iters {
                                let p = rig.run(dir_kind, &keys, DEADLINE);
                                assert!(p.is_clean(), "{:?}", p.first_error);
                                t += p.elapsed;
                            }
                            t
                        })
                    });
                }
            }
        }
        g.finish();
    }
    let _ = std::fs::remove_dir_all(&root);
}

criterion_group!(benches, posix);
criterion_main!(benches);
