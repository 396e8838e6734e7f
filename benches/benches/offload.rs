//! kvx-offload: index costs with 1,000,000 blocks indexed, and one scheduler step with 1,000
//! requests (lookup, load planning, store planning, metadata, worker results).

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvx_core::{BlockKey, EngineBlockId, RequestId};
use kvx_offload::*;

const INDEXED: u128 = 1_000_000;

fn full_manager() -> OffloadManager {
    let mut m = OffloadManager::new(INDEXED as usize, None, EvictionKind::Lru);
    let keys: Vec<BlockKey> = (0..INDEXED).map(BlockKey).collect();
    for chunk in keys.chunks(10_000) {
        assert!(m.prepare_store(chunk).no_room.is_empty(), "room");
        m.complete_store(Tier::Host, chunk, true);
    }
    m
}

fn index(c: &mut Criterion) {
    let mut g = c.benchmark_group("offload_index_1m_blocks");
    let mut m = full_manager();
    let prefix: Vec<BlockKey> = (500_000..500_032).map(BlockKey).collect();
    g.throughput(Throughput::Elements(32));
    g.bench_function("lookup_32_block_prefix", |b| {
        b.iter(|| black_box(m.lookup(black_box(&prefix))))
    });
    let mut next = INDEXED;
    g.throughput(Throughput::Elements(8));
    g.bench_function("prepare_store_8_blocks_with_eviction", |b| {
        b.iter(|| {
            let keys: Vec<BlockKey> = (next..next + 8).map(BlockKey).collect();
            next += 8;
            let d = m.prepare_store(&keys);
            assert!(d.no_room.is_empty(), "evictable");
            m.complete_store(Tier::Host, &d.host, true);
            black_box(d.evicted_host.len())
        })
    });
    g.finish();
}

fn step(c: &mut Criterion) {
    let mut g = c.benchmark_group("offload_step");
    g.throughput(Throughput::Elements(1000));
    g.bench_function("scheduler_step_1000_requests", |b| {
        let mut s = SchedulerSide::new(SchedulerConfig {
            block_tokens: 16,
            host_blocks: 200_000,
            file_blocks: None,
            eviction: EvictionKind::Lru,
            ..SchedulerConfig::default()
        })
        .unwrap();
        let mut round = 0u64;
        b.iter(|| {
            round += 1;
            for r in 0..1000u64 {
                let req = RequestId(round * 10_000 + r);
                // 16 shared prefix blocks (hits after the first round) + 1 new block.
                let mut keys: Vec<BlockKey> = (0..16)
                    .map(|i| BlockKey((r % 50) as u128 * 100 + i))
                    .collect();
                keys.push(BlockKey(((round * 10_000 + r) as u128) << 32));
                let hit = s.get_num_new_matched_tokens(req, &keys, 0);
                if let Some(t) = hit {
                    let n = (t / 16) as usize;
                    let blocks: Vec<EngineBlockId> = (0..n as u32).map(EngineBlockId).collect();
                    s.update_state_after_alloc(req, &blocks).unwrap();
                }
                let pairs: Vec<_> = keys
                    .iter()
                    .copied()
                    .map(|k| (k, EngineBlockId(0)))
                    .collect();
                s.save_blocks(req, &pairs);
                s.request_finished(req);
            }
            let meta = s.build_meta();
            // Every job succeeds.
            let mut out = WorkerOutput::default();
            for l in &meta.loads {
                out.jobs.push(JobResult {
                    job: l.job,
                    request: l.request,
                    part: JobPart::Load,
                    ok: l.blocks.iter().map(|b| b.key).collect(),
                    failed: vec![],
                    promoted: vec![],
                });
            }
            for st in &meta.stores {
                out.jobs.push(JobResult {
                    job: st.job,
                    request: st.request,
                    part: JobPart::StoreHost,
                    ok: st.blocks.iter().map(|b| b.0).collect(),
                    failed: vec![],
                    promoted: vec![],
                });
            }
            s.update_from_worker(&out);
            black_box(meta.loads.len())
        })
    });
    g.finish();
}

criterion_group!(benches, index, step);
criterion_main!(benches);
