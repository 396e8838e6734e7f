//! kvx-core tracker: tasks per second through submit → complete, and the cost of expiring
//! tasks among many in flight (it must not grow with the number in flight).

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kvx_core::*;

fn spec(
    pool: &BufferPool,
    req: u64,
    engine: Option<u32>,
    route: BackendId,
    deadline: Instant,
) -> TaskSpec {
    TaskSpec {
        request: RequestId(req),
        dir: Direction::Load,
        route: vec![route],
        blocks: vec![OpBlock {
            key: BlockKey(req as u128),
            engine: engine.map(EngineBlockId),
            buf: Buf::Owned(pool.take().expect("bench pool is large enough")),
        }],
        deadline,
        deferred: false,
    }
}

fn throughput(c: &mut Criterion) {
    let mut g = c.benchmark_group("tracker");
    const N: u64 = 10_000;
    g.throughput(Throughput::Elements(N));
    g.bench_function("submit_complete_10k_tasks", |b| {
        let pool = BufferPool::new(64, 64, 64).unwrap();
        let mut t = Tracker::new(TrackerConfig::default());
        let host = t.add_backend(true);
        let now = Instant::now();
        let deadline = now + Duration::from_secs(60);
        let mut ops = Vec::with_capacity(64);
        b.iter(|| {
            for i in 0..N {
                let id = t.submit(spec(&pool, i, Some((i % 4096) as u32), host, deadline), now);
                while let Some(BackendCommand::Submit { op, .. }) = t.poll_backend_command() {
                    ops.push(op);
                }
                for op in ops.drain(..) {
                    t.handle_completion(OpCompletion::all(op, Ok(())), now);
                }
                while let Some(ev) = t.poll_event() {
                    black_box(&ev);
                }
                black_box(id);
            }
        });
    });
    g.finish();
}

fn expiry(c: &mut Criterion) {
    let mut g = c.benchmark_group("expire_1000_tasks");
    g.sample_size(20);
    for in_flight in [10_000usize, 1_000_000] {
        g.bench_with_input(
            BenchmarkId::new("in_flight", in_flight),
            &in_flight,
            |b, &n| {
                let pool = BufferPool::new(n + 1000, 8, 8).unwrap();
                let mut t = Tracker::new(TrackerConfig {
                    zombie_budget_ops: usize::MAX,
                    zombie_budget_bytes: u64::MAX,
                });
                let file = t.add_backend(false);
                let mut now = Instant::now();
                let far = now + Duration::from_secs(3600);
                let mut held = Vec::with_capacity(n);
                for i in 0..n as u64 {
                    t.submit(spec(&pool, i, None, file, far), now);
                }
                while let Some(BackendCommand::Submit { op, .. }) = t.poll_backend_command() {
                    held.push(op);
                }
                let mut req = n as u64;
                b.iter_custom(|iters| {
                    let mut total = Duration::ZERO;
                    for _ in 0..iters {
                        let soon = now + Duration::from_millis(1);
                        let mut victims = Vec::with_capacity(1000);
                        for _ in 0..1000 {
                            req += 1;
                            t.submit(spec(&pool, req, None, file, soon), now);
                        }
                        while let Some(BackendCommand::Submit { op, .. }) = t.poll_backend_command()
                        {
                            victims.push(op);
                        }
                        now = soon;
                        let start = Instant::now();
                        t.handle_timeout(now);
                        total += start.elapsed();
                        // Not timed: drain events and the zombies' late completions.
                        while t.poll_event().is_some() {}
                        while t.poll_backend_command().is_some() {}
                        for op in victims {
                            t.handle_completion(OpCompletion::all(op, Ok(())), now);
                        }
                    }
                    total
                });
                assert_eq!(t.stats().live_tasks, n);
            },
        );
    }
    g.finish();
}

criterion_group!(benches, throughput, expiry);
criterion_main!(benches);
