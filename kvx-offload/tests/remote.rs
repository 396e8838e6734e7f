//! The remote tier between two engines over TCP on loopback: a producer exports a finished
//! request's blocks under a lease, a consumer loads them by key into its engine blocks, and
//! the producer frees them once the consumer said done, at the TTL, or never while a read may
//! still be in flight. (Separate processes, vLLM's scheduler and the faults: kvx-python's
//! tests/vllm/test_pd.py.)

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvx_core::{BlockKey, CpuArena, EngineBlockId, RequestId, TICK};
use kvx_offload::{
    EngineMemory, Offload, OffloadBuilder, OffloadConfig, RemoteSource, RemoteTierConfig,
};
use kvx_rdma::{KeeperConfig, KeptLease, LeaseKeeper};

const BLOCK: usize = 4096;

fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

struct Engine {
    arena: CpuArena,
    kvx: Offload,
}

fn engine(remote: RemoteTierConfig) -> Engine {
    engine_of_rank(remote, None)
}

/// An engine whose worker is `rank` of a tensor-parallel world of 2 (`None`: a single worker).
fn engine_of_rank(remote: RemoteTierConfig, rank: Option<u32>) -> Engine {
    let arena = CpuArena::contiguous(BLOCK, 16).unwrap();
    let cfg = OffloadConfig {
        host_blocks: 8,
        remote: Some(remote),
        ..OffloadConfig::default()
    };
    // SAFETY: the arena outlives the runtime (shut down in `Engine::close` before the arena
    // drops), and the test touches no block while an op on it is outstanding.
    let memory = unsafe { EngineMemory::cpu(arena.layout().clone()) };
    let mut b = OffloadBuilder::new(cfg, memory);
    if let Some(r) = rank {
        b = b.shard(kvx_offload::Shard::new(r, 2, 0, 1).unwrap());
    }
    let kvx = b.build().unwrap();
    Engine { arena, kvx }
}

impl Engine {
    fn close(self) {
        let Engine { arena, kvx } = self;
        drop(kvx.worker);
        kvx.runtime.shutdown();
        drop(arena);
    }
}

fn keys(n: usize) -> Vec<BlockKey> {
    let mut prev = None;
    (0..n)
        .map(|i| {
            let k = BlockKey::chain(prev, format!("block {i}").as_bytes());
            prev = Some(k);
            k
        })
        .collect()
}

/// A producer that exported request 1's blocks 0..4 (filled with 10 + i) under export 77.
fn producer(ttl_ms: u64) -> (Engine, RemoteSource) {
    let port = free_port();
    let mut p = engine(RemoteTierConfig {
        listen: Some(format!("127.0.0.1:{port}").parse().unwrap()),
        lease_ttl_ms: ttl_ms,
        heartbeat_ms: ttl_ms / 4,
        ..RemoteTierConfig::default()
    });
    let ks = keys(4);
    let mut blocks = Vec::new();
    for (i, k) in ks.iter().enumerate() {
        p.arena
            .write_block(EngineBlockId(i as u32), &[10 + i as u8; BLOCK])
            .unwrap();
        blocks.push((*k, EngineBlockId(i as u32)));
    }
    assert!(p.kvx.scheduler.export_finished(RequestId(1), 77, &blocks));
    let meta = p.kvx.scheduler.build_meta();
    assert_eq!(meta.exports.len(), 1);
    assert!(meta.delayed_free.contains(&RequestId(1)));
    assert!(p.kvx.worker.start_step(meta).unwrap().fence().is_none());
    let source = RemoteSource {
        namespace: "test".into(),
        export: 77,
        producers: vec![p.kvx.runtime.remote_addr().unwrap()],
        keys: ks,
        ttl_ms,
        heartbeat_ms: ttl_ms / 4,
    };
    (p, source)
}

fn consumer(load_ms: u64) -> Engine {
    engine(RemoteTierConfig {
        load_ms,
        ..RemoteTierConfig::default()
    })
}

/// Step `e`'s worker until `f` says its output is what the test waits for.
fn until(
    e: &mut Engine,
    within: Duration,
    mut f: impl FnMut(&kvx_offload::WorkerOutput) -> bool,
) -> Instant {
    let end = Instant::now() + within;
    loop {
        let out = e.kvx.worker.get_finished().unwrap();
        e.kvx.scheduler.update_from_worker(&out);
        if f(&out) {
            return Instant::now();
        }
        assert!(Instant::now() < end, "not within {within:?}");
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// Load all four blocks of `source` into `c`'s engine blocks 0..4 as `req`; how long until the
/// load was reported, and the blocks reported invalid.
fn load_all(
    c: &mut Engine,
    req: RequestId,
    source: RemoteSource,
) -> (Duration, Vec<EngineBlockId>) {
    let wanted: Vec<(u32, EngineBlockId)> = (0..4).map(|i| (i, EngineBlockId(i))).collect();
    c.kvx.scheduler.remote_load(req, Arc::new(source), &wanted);
    let meta = c.kvx.scheduler.build_meta();
    let t0 = Instant::now();
    assert!(c.kvx.worker.start_step(meta).unwrap().fence().is_none());
    let mut invalid = Vec::new();
    let at = until(c, Duration::from_secs(5), |o| {
        invalid.extend_from_slice(&o.invalid_blocks);
        !o.finished_recving.is_empty()
    });
    invalid.sort();
    (at - t0, invalid)
}

#[test]
fn a_consumer_loads_a_producers_blocks_and_done_frees_them() {
    let (mut p, source) = producer(30_000);
    let mut c = consumer(5_000);
    let keeper = LeaseKeeper::new(KeeperConfig::default()).unwrap();
    keeper.keep(5, source.descriptors()).unwrap();
    let end = Instant::now() + Duration::from_secs(2);
    while keeper.status(5) != Some(KeptLease::Live) {
        assert!(
            Instant::now() < end,
            "lease never confirmed: {:?}",
            keeper.status(5)
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    // Blocks 1..4 of the source into the consumer's engine blocks 9..12 (block 0 was a local hit).
    let wanted: Vec<(u32, EngineBlockId)> = (1..4).map(|i| (i, EngineBlockId(8 + i))).collect();
    c.kvx
        .scheduler
        .remote_load(RequestId(5), Arc::new(source), &wanted);
    let meta = c.kvx.scheduler.build_meta();
    assert_eq!(meta.remote_loads.len(), 1);
    assert!(c.kvx.worker.start_step(meta).unwrap().fence().is_none());
    let mut recv = None;
    until(&mut c, Duration::from_secs(5), |o| {
        if !o.finished_recving.is_empty() {
            recv = Some(o.clone());
        }
        recv.is_some()
    });
    let out = recv.unwrap();
    assert_eq!(out.finished_recving, vec![RequestId(5)]);
    assert!(out.invalid_blocks.is_empty(), "{:?}", out.invalid_blocks);
    for (i, e) in &wanted {
        assert_eq!(c.arena.read_block(*e).unwrap(), vec![10 + *i as u8; BLOCK]);
    }
    assert_eq!(
        c.kvx.scheduler.request_count(),
        1,
        "the request itself goes on"
    );
    assert_eq!(c.kvx.scheduler.job_count(), 0);
    // The producer holds the blocks until the consumer says done, then reports the request.
    std::thread::sleep(Duration::from_millis(20));
    assert!(
        p.kvx
            .worker
            .get_finished()
            .unwrap()
            .finished_sending
            .is_empty()
    );
    let t0 = Instant::now();
    assert!(keeper.release(5, true));
    let at = until(&mut p, Duration::from_secs(2), |o| {
        o.finished_sending == vec![RequestId(1)]
    });
    // One round trip on loopback plus the polling step.
    assert!(at - t0 < Duration::from_millis(50) + TICK, "{:?}", at - t0);
    assert_eq!(p.kvx.worker.in_flight(), 0);
    assert_eq!(c.kvx.worker.in_flight(), 0);
    p.close();
    c.close();
}

#[test]
fn a_lease_no_reader_renews_frees_the_blocks_at_its_ttl_and_a_later_read_fails() {
    let ttl = 300;
    let t0 = Instant::now();
    let (mut p, source) = producer(ttl);
    let at = until(&mut p, Duration::from_secs(2), |o| {
        o.finished_sending == vec![RequestId(1)]
    });
    let took = at - t0;
    assert!(took >= Duration::from_millis(ttl), "{took:?}");
    assert!(took <= Duration::from_millis(ttl + 50) + TICK, "{took:?}");
    // A consumer that reads after the TTL gets every block failed, at once, not at its deadline.
    let mut c = consumer(5_000);
    let (took, invalid) = load_all(&mut c, RequestId(2), source);
    assert!(took < Duration::from_millis(50) + TICK, "{took:?}");
    assert_eq!(invalid, (0..4).map(EngineBlockId).collect::<Vec<_>>());
    p.close();
    c.close();
}

#[test]
fn a_producer_gone_mid_load_fails_the_unread_blocks_by_the_deadline() {
    let (p, source) = producer(30_000);
    // The producer stops serving (its process died): connections are refused or reset.
    p.close();
    let load_ms = 200;
    let mut c = consumer(load_ms);
    let (took, invalid) = load_all(&mut c, RequestId(3), source);
    assert!(
        took <= Duration::from_millis(load_ms + 50) + TICK,
        "{took:?}"
    );
    assert_eq!(invalid.len(), 4);
    assert_eq!(c.kvx.worker.in_flight(), 0);
    c.close();
}

#[test]
fn a_source_for_another_rank_or_without_a_remote_tier_fails_its_blocks_at_once() {
    let (p, mut source) = producer(30_000);
    source.producers.clear();
    let mut c = consumer(5_000);
    c.kvx.scheduler.remote_load(
        RequestId(4),
        Arc::new(source),
        &[(0, EngineBlockId(0)), (9, EngineBlockId(1))],
    );
    let meta = c.kvx.scheduler.build_meta();
    assert!(c.kvx.worker.start_step(meta).unwrap().fence().is_none());
    let out = c.kvx.worker.get_finished().unwrap();
    assert_eq!(out.finished_recving, vec![RequestId(4)]);
    assert_eq!(out.invalid_blocks.len(), 2);
    p.close();
    c.close();
}

/// Two free ports in a row (a producer of two ranks listens on port and port + 1).
fn two_free_ports() -> u16 {
    loop {
        let base = free_port();
        if base < u16::MAX && std::net::TcpListener::bind(("127.0.0.1", base + 1)).is_ok() {
            return base;
        }
    }
}

#[test]
fn each_tensor_parallel_rank_reads_its_own_producer_rank() {
    let port = two_free_ports();
    let remote_p = RemoteTierConfig {
        listen: Some(format!("127.0.0.1:{port}").parse().unwrap()),
        heartbeat_ms: 1_000,
        ..RemoteTierConfig::default()
    };
    let ks = keys(4);
    let blocks: Vec<(BlockKey, EngineBlockId)> = ks
        .iter()
        .enumerate()
        .map(|(i, k)| (*k, EngineBlockId(i as u32)))
        .collect();
    // Each producer rank holds its own shard of every block: bytes 10 * rank + block + 1.
    let mut producers: Vec<Engine> = (0..2)
        .map(|r| {
            let mut p = engine_of_rank(remote_p.clone(), Some(r));
            for i in 0..4u32 {
                p.arena
                    .write_block(EngineBlockId(i), &[(10 * r + i + 1) as u8; BLOCK])
                    .unwrap();
            }
            // Both ranks' scheduler sides decide the same (vLLM's one scheduler, every rank's
            // copy of its metadata).
            assert!(p.kvx.scheduler.export_finished(RequestId(1), 88, &blocks));
            let meta = p.kvx.scheduler.build_meta();
            assert!(p.kvx.worker.start_step(meta).unwrap().fence().is_none());
            assert_eq!(p.kvx.runtime.remote_addr().unwrap().port(), port + r as u16);
            p
        })
        .collect();
    let source = RemoteSource {
        namespace: "test".into(),
        export: 88,
        producers: remote_p.producers(2).unwrap(),
        keys: ks,
        ttl_ms: remote_p.lease_ttl_ms,
        heartbeat_ms: remote_p.heartbeat_ms,
    };
    let keeper = LeaseKeeper::new(KeeperConfig::default()).unwrap();
    keeper.keep(9, source.descriptors()).unwrap();
    let end = Instant::now() + Duration::from_secs(2);
    while keeper.status(9) != Some(KeptLease::Live) {
        assert!(Instant::now() < end, "{:?}", keeper.status(9));
        std::thread::sleep(Duration::from_millis(1));
    }
    for r in 0..2u32 {
        let mut c = engine_of_rank(RemoteTierConfig::default(), Some(r));
        let (_, invalid) = load_all(&mut c, RequestId(9), source.clone());
        assert!(invalid.is_empty(), "rank {r}: {invalid:?}");
        for i in 0..4u32 {
            let want = vec![(10 * r + i + 1) as u8; BLOCK];
            assert_eq!(
                c.arena.read_block(EngineBlockId(i)).unwrap(),
                want,
                "rank {r} block {i}"
            );
        }
        c.close();
    }
    // One done per producer rank (the keeper's), and each rank reports the request sent.
    assert!(keeper.release(9, true));
    for p in &mut producers {
        until(p, Duration::from_secs(2), |o| {
            o.finished_sending == vec![RequestId(1)]
        });
    }
    for p in producers {
        p.close();
    }
}
