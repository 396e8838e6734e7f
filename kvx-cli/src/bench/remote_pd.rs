//! `kvx bench remote --through-connector`: prefill → decode through kvx-offload's two sides, as
//! an engine runs them. A producer engine exports a finished request's blocks
//! (`SchedulerSide::export_finished`), a consumer engine keeps the lease (kvx-rdma's
//! `LeaseKeeper`), loads them (`SchedulerSide::remote_load`) and reports them; the producer
//! frees them once the consumer said done. Both engines live in this process over loopback TCP;
//! a plain socket copy of the same bytes over the same loopback runs in the same run.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvx_core::{BlockKey, CpuArena, EngineBlockId, RequestId};
use kvx_offload::{
    EngineMemory, Offload, OffloadBuilder, OffloadConfig, RemoteSource, RemoteTierConfig,
};
use kvx_rdma::bench::raw_tcp_hot_copy;
use kvx_rdma::{KeeperConfig, KeptLease, LeaseKeeper};

/// One engine: its KV memory and kvx over it.
struct Engine {
    arena: CpuArena,
    kvx: Offload,
}

impl Engine {
    fn new(block_bytes: usize, blocks: u32, remote: RemoteTierConfig) -> Result<Engine, String> {
        let arena = CpuArena::contiguous(block_bytes, blocks).map_err(|e| e.to_string())?;
        let cfg = OffloadConfig {
            host_blocks: 1,
            remote: Some(remote),
            ..OffloadConfig::default()
        };
        // SAFETY: the arena outlives the runtime (`close` shuts it down before the arena
        // drops), and the bench writes no block while an op on it is outstanding.
        let memory = unsafe { EngineMemory::cpu(arena.layout().clone()) };
        let kvx = OffloadBuilder::new(cfg, memory)
            .build()
            .map_err(|e| e.to_string())?;
        Ok(Engine { arena, kvx })
    }

    fn close(self) {
        let Engine { arena, kvx } = self;
        drop(kvx.worker);
        kvx.runtime.shutdown();
        drop(arena);
    }

    /// Poll the worker (one engine step's `get_finished`) until `done` says so.
    fn poll_until(
        &mut self,
        within: Duration,
        step_cost: &mut Vec<Duration>,
        mut done: impl FnMut(&kvx_offload::WorkerOutput) -> bool,
    ) -> Result<(), String> {
        let end = Instant::now() + within;
        loop {
            let t0 = Instant::now();
            let out = self.kvx.worker.get_finished().map_err(|e| e.to_string())?;
            self.kvx.scheduler.update_from_worker(&out);
            step_cost.push(t0.elapsed());
            if done(&out) {
                return Ok(());
            }
            if Instant::now() > end {
                return Err(format!("no answer within {within:?}"));
            }
            std::hint::spin_loop();
        }
    }
}

/// What one P→D run measured.
pub struct PdResult {
    /// Bytes moved by the measured rounds.
    pub bytes: u64,
    /// Blocks loaded per second.
    pub blocks_s: f64,
    /// Through the connector path, GiB/s.
    pub gib_s: f64,
    /// A raw socket copy of the same bytes over loopback, GiB/s.
    pub raw_gib_s: f64,
    /// Median cost of the consumer's `start_step` that starts the load.
    pub start_step_p50: Duration,
    /// Median cost of one `get_finished` + `update_from_worker` while the load runs.
    pub poll_p50: Duration,
    /// Median time from the consumer's done to the producer reporting the request sent.
    pub release_p50: Duration,
}

fn free_port() -> Result<u16, String> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    Ok(l.local_addr().map_err(|e| e.to_string())?.port())
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v.get(v.len() / 2).copied().unwrap_or_default()
}

/// Move `blocks` blocks of `block_bytes` from a producer to a consumer `rounds` times (after a
/// warm-up round), each round one request through both connector sides.
pub fn measure(block_bytes: usize, blocks: u32, rounds: usize) -> Result<PdResult, String> {
    let port = free_port()?;
    let mut p = Engine::new(
        block_bytes,
        blocks,
        RemoteTierConfig {
            listen: Some(
                format!("127.0.0.1:{port}")
                    .parse()
                    .map_err(|e| format!("{e}"))?,
            ),
            ..RemoteTierConfig::default()
        },
    )?;
    let mut c = Engine::new(block_bytes, blocks, RemoteTierConfig::default())?;
    for b in 0..blocks {
        p.arena
            .write_block(EngineBlockId(b), &vec![b as u8; block_bytes])
            .map_err(|e| e.to_string())?;
    }
    let keeper = LeaseKeeper::new(KeeperConfig::default()).map_err(|e| e.to_string())?;
    let (mut load_t, mut starts, mut polls, mut releases) =
        (Duration::ZERO, Vec::new(), Vec::new(), Vec::new());
    for round in 0..=rounds {
        let req = RequestId(round as u64 + 1);
        let keys: Vec<BlockKey> = (0..blocks)
            .map(|b| BlockKey::chain(None, format!("{round}/{b}").as_bytes()))
            .collect();
        let pairs: Vec<(BlockKey, EngineBlockId)> = keys
            .iter()
            .enumerate()
            .map(|(i, k)| (*k, EngineBlockId(i as u32)))
            .collect();
        let export = 1000 + round as u64;
        p.kvx.scheduler.export_finished(req, export, &pairs);
        let _ = p
            .kvx
            .worker
            .start_step(p.kvx.scheduler.build_meta())
            .map_err(|e| e.to_string())?;
        let source = Arc::new(RemoteSource {
            namespace: "bench".into(),
            export,
            producers: vec![p.kvx.runtime.remote_addr().ok_or("no producer server")?],
            keys,
            ttl_ms: 60_000,
            heartbeat_ms: 10_000,
        });
        keeper
            .keep(req.0, source.descriptors())
            .map_err(|e| e.to_string())?;
        let end = Instant::now() + Duration::from_secs(5);
        while keeper.status(req.0) != Some(KeptLease::Live) {
            if Instant::now() > end {
                return Err(format!("lease not confirmed: {:?}", keeper.status(req.0)));
            }
            std::thread::sleep(Duration::from_micros(100));
        }
        let wanted: Vec<(u32, EngineBlockId)> =
            (0..blocks).map(|b| (b, EngineBlockId(b))).collect();
        c.kvx.scheduler.remote_load(req, source, &wanted);
        let meta = c.kvx.scheduler.build_meta();
        let t0 = Instant::now();
        let _ = c.kvx.worker.start_step(meta).map_err(|e| e.to_string())?;
        let started = t0.elapsed();
        let mut round_polls = Vec::new();
        let mut failed = 0;
        c.poll_until(Duration::from_secs(60), &mut round_polls, |o| {
            failed += o.invalid_blocks.len();
            !o.finished_recving.is_empty()
        })?;
        let took = t0.elapsed();
        if failed > 0 {
            return Err(format!("{failed} blocks failed to load"));
        }
        let t1 = Instant::now();
        keeper.release(req.0, true);
        let mut ignored = Vec::new();
        p.poll_until(Duration::from_secs(5), &mut ignored, |o| {
            o.finished_sending.contains(&req)
        })?;
        if round > 0 {
            load_t += took;
            starts.push(started);
            polls.extend(round_polls);
            releases.push(t1.elapsed());
        }
        c.kvx.scheduler.request_finished(req);
        let _ = c
            .kvx
            .worker
            .start_step(c.kvx.scheduler.build_meta())
            .map_err(|e| e.to_string())?;
    }
    // The consumer's blocks hold the producer's bytes.
    for b in [0, blocks - 1] {
        let got = c
            .arena
            .read_block(EngineBlockId(b))
            .map_err(|e| e.to_string())?;
        if got != vec![b as u8; block_bytes] {
            return Err(format!(
                "consumer block {b} does not hold the producer's bytes"
            ));
        }
    }
    let bytes = (block_bytes as u64) * u64::from(blocks) * rounds as u64;
    let raw = raw_tcp_hot_copy(bytes, block_bytes).map_err(|e| format!("raw TCP copy: {e}"))?;
    p.close();
    c.close();
    let gib = |t: Duration| bytes as f64 / t.as_secs_f64() / (1u64 << 30) as f64;
    Ok(PdResult {
        bytes,
        blocks_s: (u64::from(blocks) * rounds as u64) as f64 / load_t.as_secs_f64(),
        gib_s: gib(load_t),
        raw_gib_s: gib(raw),
        start_step_p50: median(starts),
        poll_p50: median(polls),
        release_p50: median(releases),
    })
}
