//! Two workers, each with its own shard of every block (tensor-parallel ranks), behind one
//! scheduler side: stores count once both ranks stored, the file tier keeps one file per block
//! per shard, a restarted scheduler adopts only blocks every shard holds, and each rank loads
//! its own bytes back.

use std::time::Duration;

use kvx_core::{BlockKey, CpuArena, EngineBlockId, RequestId};
use kvx_offload::{
    EngineMemory, FileTierConfig, OffloadBuilder, OffloadConfig, OffloadRuntime, SchedulerSide,
    Shard, Tier, WorkerSide, scheduler_side_sharded,
};

const BYTES: usize = 4096;
const T: Duration = Duration::from_secs(10);

struct Rank {
    arena: CpuArena,
    worker: WorkerSide,
    runtime: Option<OffloadRuntime>,
}

fn cfg(dir: &std::path::Path) -> OffloadConfig {
    OffloadConfig {
        host_blocks: 8,
        file: Some(FileTierConfig::new(dir, 64)),
        ..OffloadConfig::default()
    }
}

fn rank(dir: &std::path::Path, tp_rank: u32) -> Rank {
    let arena = CpuArena::contiguous(BYTES, 8).unwrap();
    // SAFETY: the arena outlives the runtime (shut down in `step_all`'s caller before drop).
    let memory = unsafe { EngineMemory::cpu(arena.layout().clone()) };
    let built = OffloadBuilder::new(cfg(dir), memory)
        .shard(Shard::new(tp_rank, 2, 0, 1).unwrap())
        .build()
        .unwrap();
    Rank {
        arena,
        worker: built.worker,
        runtime: Some(built.runtime),
    }
}

/// Hand this step's metadata to both ranks and feed their outputs back until both are idle.
fn step_all(s: &mut SchedulerSide, ranks: &mut [Rank]) -> Vec<kvx_offload::WorkerOutput> {
    let meta = s.build_meta();
    let mut outs = Vec::new();
    for (i, r) in ranks.iter_mut().enumerate() {
        assert!(r.worker.start_step(meta.clone()).unwrap().fence().is_none());
        let out = r.worker.drain(T).unwrap();
        s.update_from_rank(i as u32, &out);
        outs.push(out);
    }
    outs
}

fn bytes(rank: u32, block: u32) -> Vec<u8> {
    vec![(rank * 16 + block + 1) as u8; BYTES]
}

#[test]
fn each_rank_stores_and_loads_its_own_shard_and_incomplete_blocks_are_not_adopted() {
    let dir = tempfile::tempdir().unwrap();
    let keys: Vec<BlockKey> = (0..3u8).map(|i| BlockKey::chain(None, &[i])).collect();
    {
        let mut s = scheduler_side_sharded(&cfg(dir.path()), 2, 1).unwrap();
        assert_eq!(s.world(), 2);
        let mut ranks = vec![rank(dir.path(), 0), rank(dir.path(), 1)];
        for (ri, r) in ranks.iter_mut().enumerate() {
            for b in 0..3 {
                r.arena
                    .write_block(EngineBlockId(b), &bytes(ri as u32, b))
                    .unwrap();
            }
        }
        let pairs: Vec<_> = keys
            .iter()
            .enumerate()
            .map(|(i, k)| (*k, EngineBlockId(i as u32)))
            .collect();
        s.save_blocks(RequestId(1), &pairs).unwrap();
        assert!(s.request_finished(RequestId(1)));
        let outs = step_all(&mut s, &mut ranks);
        assert!(
            outs.iter()
                .all(|o| o.finished_sending == vec![RequestId(1)])
        );
        for k in &keys {
            assert!(
                s.manager().is_stored(Tier::File, *k),
                "{k} in the file tier"
            );
        }
        assert_eq!(
            (s.request_count(), s.job_count(), s.partial_count()),
            (0, 0, 0)
        );
        for r in &mut ranks {
            r.runtime.take().unwrap().shutdown();
        }
    }
    // One file per block per shard, under the shard's own directory.
    for s in Shard::all(2, 1) {
        let d = dir.path().join(s.dir_name());
        let n = walk_count(&d);
        assert_eq!(n, 3, "{} holds {n} block files", d.display());
    }
    // Rank 1 loses its shard of the last block: after a restart that block is not adopted.
    let lost = shard_file(dir.path(), Shard::new(1, 2, 0, 1).unwrap(), keys[2]);
    std::fs::remove_file(&lost).unwrap();
    let mut s = scheduler_side_sharded(&cfg(dir.path()), 2, 1).unwrap();
    assert_eq!(s.manager().blocks(Tier::File), 2);
    let mut ranks = vec![rank(dir.path(), 0), rank(dir.path(), 1)];
    assert_eq!(
        s.get_num_new_matched_tokens(RequestId(2), &keys, 0),
        Some(32)
    );
    s.update_state_after_alloc(RequestId(2), &[EngineBlockId(5), EngineBlockId(6)])
        .unwrap();
    let outs = step_all(&mut s, &mut ranks);
    for (ri, (o, r)) in outs.iter().zip(&mut ranks).enumerate() {
        assert_eq!(o.finished_recving, vec![RequestId(2)]);
        assert!(o.invalid_blocks.is_empty());
        r.runtime.take().unwrap().shutdown();
        for (b, e) in [(0, 5), (1, 6)] {
            assert_eq!(
                r.arena.read_block(EngineBlockId(e)).unwrap(),
                bytes(ri as u32, b),
                "rank {ri} engine block {e} holds its own shard of block {b}"
            );
        }
    }
    // Promoted into both ranks' host tiers.
    assert_eq!(s.manager().blocks(Tier::Host), 2);
}

#[test]
fn a_layout_of_one_worker_keeps_the_roots_as_they_are() {
    let dir = tempfile::tempdir().unwrap();
    let s = scheduler_side_sharded(&cfg(dir.path()), 1, 1).unwrap();
    assert_eq!(s.world(), 1);
    assert!(scheduler_side_sharded(&cfg(dir.path()), 0, 1).is_err());
    let arena = CpuArena::contiguous(BYTES, 8).unwrap();
    // SAFETY: the arena outlives the runtime, shut down below.
    let memory = unsafe { EngineMemory::cpu(arena.layout().clone()) };
    let built = OffloadBuilder::new(cfg(dir.path()), memory)
        .shard(Shard::new(0, 1, 0, 1).unwrap())
        .build()
        .unwrap();
    built.runtime.shutdown();
    let names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(!names.iter().any(|n| n.starts_with("shard-")), "{names:?}");
}

fn shard_file(root: &std::path::Path, s: Shard, key: BlockKey) -> std::path::PathBuf {
    let hex = key.to_hex();
    root.join(s.dir_name())
        .join(&hex[..2])
        .join(format!("{hex}.kvb"))
}

fn walk_count(d: &std::path::Path) -> usize {
    std::fs::read_dir(d)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().len() == 2)
        .map(|e| {
            std::fs::read_dir(e.path())
                .unwrap()
                .filter(|f| {
                    f.as_ref()
                        .unwrap()
                        .file_name()
                        .to_string_lossy()
                        .ends_with(".kvb")
                })
                .count()
        })
        .sum()
}
