//! A closed-loop driver of a [`PosixStore`] for benchmarks (`kvx bench posix`, criterion): keeps
//! `queue_depth` single-block ops in flight, stores or loads a set of keys, and measures
//! throughput and per-op latency.

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use kvx_core::{
    Backend, BlockKey, Buf, BufferPool, DEFAULT_ALIGN, Direction, Notifier, Op, OpBlock,
    OpCompletion, OpId, RequestId, TaskId,
};
use rustc_hash::FxHashMap;

use crate::config::PosixConfig;
use crate::error::PosixError;
use crate::store::{PosixHandle, PosixStore};

/// The result of one phase (all stores, or all loads).
#[derive(Debug, Clone)]
pub struct Phase {
    /// Payload bytes moved.
    pub bytes: u64,
    /// Wall time from the first submit to the last completion.
    pub elapsed: Duration,
    /// Per-op latency (submit to completion seen), sorted.
    pub latencies: Vec<Duration>,
}

impl Phase {
    /// Throughput in GiB/s.
    pub fn gib_s(&self) -> f64 {
        self.bytes as f64 / (1u64 << 30) as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }

    /// Latency percentile `p` (0..=100) in microseconds.
    pub fn percentile_us(&self, p: f64) -> f64 {
        if self.latencies.is_empty() {
            return 0.0;
        }
        let i = ((p / 100.0) * (self.latencies.len() - 1) as f64).round() as usize;
        self.latencies[i.min(self.latencies.len() - 1)].as_secs_f64() * 1e6
    }
}

/// A store with a staging pool of `queue_depth` buffers, driven in a closed loop.
pub struct BenchRig {
    store: PosixStore,
    pool: BufferPool,
    block_size: usize,
    queue_depth: usize,
    wake: Arc<(Mutex<bool>, Condvar)>,
    next_op: u64,
}

impl BenchRig {
    /// Open a store with `cfg` and a pool of `cfg.queue_depth` buffers of `block_size`.
    pub fn new(cfg: PosixConfig, block_size: usize) -> Result<BenchRig, PosixError> {
        let queue_depth = cfg.queue_depth * cfg.rings.max(1);
        let mut store = PosixStore::open(cfg)?;
        let pool = BufferPool::new(queue_depth, block_size, DEFAULT_ALIGN)
            .map_err(|e| PosixError::Bench(format!("staging pool: {e}")))?;
        // Give every buffer a payload once; stores send it as is.
        let mut all = Vec::new();
        while let Some(mut b) = pool.take() {
            for (i, x) in b.as_mut_slice().iter_mut().enumerate() {
                *x = (i as u8).wrapping_mul(31).wrapping_add(7);
            }
            all.push(b);
        }
        drop(all);
        let wake = Arc::new((Mutex::new(false), Condvar::new()));
        let w = wake.clone();
        store.set_notifier(Notifier::new(move || {
            let (m, cv) = &*w;
            *m.lock().unwrap_or_else(|e| e.into_inner()) = true;
            cv.notify_one();
        }));
        Ok(BenchRig {
            store,
            pool,
            block_size,
            queue_depth,
            wake,
            next_op: 1,
        })
    }

    /// The store's handle (capabilities, counters, lookups).
    pub fn handle(&self) -> PosixHandle {
        self.store.handle()
    }

    fn park(&self) {
        let (m, cv) = &*self.wake;
        let mut woken = m.lock().unwrap_or_else(|e| e.into_inner());
        if !*woken {
            woken = cv
                .wait_timeout(woken, Duration::from_millis(20))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        *woken = false;
    }

    /// Store (or load) every key once, `queue_depth` single-block ops in flight; fails on the
    /// first block that does not succeed.
    pub fn run(&mut self, dir: Direction, keys: &[BlockKey]) -> Result<Phase, PosixError> {
        let mut inflight: FxHashMap<OpId, Instant> = FxHashMap::default();
        let mut latencies = Vec::with_capacity(keys.len());
        let mut out: Vec<OpCompletion> = Vec::new();
        let mut next = 0;
        let t0 = Instant::now();
        while latencies.len() < keys.len() {
            while inflight.len() < self.queue_depth && next < keys.len() {
                let Some(mut buf) = self.pool.take() else {
                    break;
                };
                buf.set_len(self.block_size);
                let id = OpId(self.next_op);
                self.next_op += 1;
                let now = Instant::now();
                let op = Op {
                    id,
                    task: TaskId(id.0),
                    request: RequestId(0),
                    dir,
                    deadline: now + Duration::from_secs(120),
                    blocks: vec![OpBlock {
                        key: keys[next],
                        engine: None,
                        buf: Buf::Owned(buf),
                    }],
                };
                next += 1;
                self.store
                    .submit(op)
                    .map_err(|e| PosixError::Bench(format!("submit refused: {}", e.kind)))?;
                inflight.insert(id, now);
            }
            self.store.poll(&mut out);
            if out.is_empty() {
                self.park();
                continue;
            }
            let now = Instant::now();
            for c in out.drain(..) {
                if let Some(start) = inflight.remove(&c.op.id) {
                    latencies.push(now - start);
                }
                if let Some(Err(e)) = c.results.iter().find(|r| r.is_err()) {
                    return Err(PosixError::Bench(format!(
                        "{dir} of {} failed: {e}",
                        c.op.blocks[0].key
                    )));
                }
            }
        }
        let elapsed = t0.elapsed();
        latencies.sort_unstable();
        Ok(Phase {
            bytes: (keys.len() * self.block_size) as u64,
            elapsed,
            latencies,
        })
    }
}

/// `n` distinct keys for a benchmark run `seed`.
pub fn bench_keys(seed: u64, n: usize) -> Vec<BlockKey> {
    (0..n as u64)
        .map(|i| BlockKey::chain(None, &[seed.to_le_bytes(), i.to_le_bytes()].concat()))
        .collect()
}
